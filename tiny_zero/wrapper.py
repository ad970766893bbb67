"""What every strategy's model wrapper shares.

A strategy's wrapper (DDP, Zero1, ...) subclasses Wrapper and sets
`layer_classes`: its own Linear/LayerNorm/Embedding subclasses. Wrapper checks
the model, converts its layers, and gives each layer a reference back to the
wrapper, which owns the strategy's buffers. The strategy fills in:

    queue               a BucketQueue, if backward sends buckets as they fill
    sync_grads()        finish the gradient collectives: after it, each rank's
                        grads are averaged over ranks (called once per step)
    local_grads()       the grads this rank owns, each parameter counted once
                        across ranks (sharded) or fully on every rank (ddp)
    full_state_dict()   full fp32 tensors, keys as module.state_dict()
    pieces()            where this rank's part of each parameter lives (Piece)
"""
from collections import namedtuple
from contextlib import contextmanager

import torch
import torch.nn as nn

from . import comm
from .distributed import init_distributed, local_device
from .module import CallbackLayer, check_supported, swap_layers


# Elements [lo, hi) of parameter `name` (flattened, full shape `shape`) are
# held by this rank at tensor.view(-1)[offset:offset + hi - lo], where
# `tensor` is one of the optimizer's parameters (model.optimizer_params()).
Piece = namedtuple("Piece", "name shape lo hi tensor offset")


def flat_pieces(names, bucket, chunk, chunk_start):
    """Pieces of the params of `bucket` (a run laid out flat) that fall in
    [chunk_start, chunk_start + chunk.numel()) of the bucket: zero1/2, fsdp."""
    pieces = []
    for p in bucket.params:
        begin, shape = bucket.offsets[p], bucket.shapes[p]
        lo, hi = max(begin, chunk_start), min(begin + shape.numel(), chunk_start + chunk.numel())
        if lo < hi:
            pieces.append(Piece(names[p], shape, lo - begin, hi - begin, chunk, lo - chunk_start))
    return pieces


class StrategyLayer:
    """Mixed into every strategy's layers: a forward that a backward will
    follow tells the wrapper which parameters will receive grads."""

    def forward_callback(self, ctx, x):
        if any(ctx.needs_input_grad):
            self.wrapper.expect_grads(self.parameters(recurse=False))
        return super().forward_callback(ctx, x)


class Wrapper(nn.Module):
    layer_classes = None  # {nn.Linear: ..., nn.LayerNorm: ..., nn.Embedding: ...}
    grads_sharded = True  # False: every rank holds the same full grads (ddp)

    def __init__(self, module, device=None):
        super().__init__()
        check_supported(module)  # local, before any collective: every rank raises alike
        check_not_wrapped(module)
        self.rank, self.world_size = init_distributed()
        self.device = torch.device(device) if device is not None else local_device()
        check_same_model_on_all_ranks(module)
        swap_layers(module, self.layer_classes)
        for layer in module.modules():
            if isinstance(layer, CallbackLayer):
                layer.__dict__["wrapper"] = self  # a plain attribute, not a submodule
        self.module = module
        self.require_grad_sync = True
        self.grads_synced = True  # no backward has run since the last sync
        self.queue = None
        self.named_params = list(module.named_parameters())  # tied parameters appear once

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate grads locally; the first backward
        outside sends the sum."""
        self.require_grad_sync = False
        try:
            yield
        finally:
            self.require_grad_sync = True

    def expect_grads(self, params):
        """Called by a layer's forward when a backward will follow."""
        self.grads_synced = False
        if self.queue is not None:
            self.queue.used_in_forward(params)

    def finish_grad_sync(self):
        """Complete this step's gradient averaging; a no-op when already done
        or inside no_sync()."""
        if self.require_grad_sync and not self.grads_synced:
            self.sync_grads()
            if self.queue is not None:
                self.queue.new_step()
            self.grads_synced = True

    def param_names(self):
        return {p: name for name, p in self.named_params}

    def backward(self, loss):
        loss.backward()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """Scale grads so that their global 2-norm is at most max_norm, as
        torch.nn.utils.clip_grad_norm_ does on the unsharded model. Returns the
        norm before clipping."""
        self.finish_grad_sync()
        grads = self.local_grads()
        square_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            square_sum += g.float().square().sum()
        if self.grads_sharded:
            comm.all_reduce(square_sum)  # each rank holds a disjoint part
        total_norm = square_sum.sqrt()
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total_norm.item()


def check_not_wrapped(module):
    for layer in module.modules():
        if "wrapper" in layer.__dict__:
            raise RuntimeError(f"{type(module).__name__} is already wrapped by "
                               f"{type(layer.__dict__['wrapper']).__name__}: wrap the plain module once")


def check_same_model_on_all_ranks(module):
    """One all_gather of the parameter list: names, shapes and dtypes must match,
    or every rank raises (rather than hang or train garbage)."""
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
    everyone = comm.all_gather_object(mine)
    for rank, theirs in enumerate(everyone):
        if theirs != mine:
            first = next((f"{a} vs {b}" for a, b in zip(mine, theirs) if a != b),
                         f"{len(mine)} vs {len(theirs)} parameters")
            raise RuntimeError(f"the model differs across ranks (this rank vs rank {rank}): {first}")

