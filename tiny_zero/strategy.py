"""What every strategy's model wrapper shares.

A strategy's wrapper (DDP, Zero1, ...) subclasses Wrapper and sets
`layer_classes`: its own Linear/LayerNorm/Embedding subclasses. Wrapper checks
the model, converts its layers, and gives each layer a reference back to the
wrapper, which owns the strategy's buffers. The strategy fills in:

    queue               a BucketQueue, if backward sends buckets as they fill
    sync_grads()        finish the gradient collectives: after it, each rank's
                        grads are averaged over ranks (called once per step)
    optimizer_params()  the tensors this rank's optimizer steps
    grads_of            {optimizer param: its averaged grad} (any float dtype)
    after_step()        what follows the optimizer step (zero1/2: all-gather)
    gather_full()       {parameter: full fp32 value}, from the fp32 masters
    pieces()            where this rank's part of each parameter lives (Piece)

Under mixed precision the parameters are bf16/fp16, the grads are reduced in
`reduce_dtype` (the parameter dtype unless asked otherwise), and the
optimizer keeps the fp32 masters (master() finds them).
"""
import logging
from collections import namedtuple
from contextlib import contextmanager

import torch
import torch.nn as nn

from . import comm
from .distributed import init_distributed, local_device
from .module import CallbackLayer, check_supported, swap_layers
from .optim import AdamW
from .precision import LossScaler, param_dtype

log = logging.getLogger("tiny_zero")


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


def recomputing():
    """True for a forward run inside backward: activation checkpointing
    recomputing a block. Its parameters get no extra grad contribution."""
    return torch._C._current_graph_task_id() != -1


def expects_backward(ctx):
    """A forward that a backward will follow (not under no_grad, not a recompute)."""
    return any(ctx.needs_input_grad) and not recomputing()


class StrategyLayer:
    """Mixed into every strategy's layers: a forward that a backward will
    follow tells the wrapper which parameters will receive grads; and
    comm.where names the layer, for the error of a collective that hangs."""

    def forward_callback(self, ctx, x):
        comm.where = f"{self.path} forward"
        if expects_backward(ctx):
            self.wrapper.expect_grads(self.parameters(recurse=False))
        return super().forward_callback(ctx, x)

    def backward_callback(self, ctx, grad_out):
        comm.where = f"{self.path} backward"
        return super().backward_callback(ctx, grad_out)


class Wrapper(nn.Module):
    layer_classes = None  # {nn.Linear: ..., nn.LayerNorm: ..., nn.Embedding: ...}
    grads_sharded = True  # False: every rank holds the same full grads (ddp)

    def __init__(self, module, mixed_precision=None, reduce_dtype=None, loss_scaler=None, device=None):
        super().__init__()
        check_supported(module)  # local, before any collective: every rank raises alike
        check_not_wrapped(module)
        self.param_dtype = param_dtype(mixed_precision)
        self.reduce_dtype = reduce_dtype or self.param_dtype
        if loss_scaler is not None and mixed_precision != "fp16":
            raise ValueError("loss_scaler is for mixed_precision='fp16' only")
        self.loss_scaler = loss_scaler or (LossScaler() if mixed_precision == "fp16" else None)
        self.rank, self.world_size = init_distributed()
        self.device = torch.device(device) if device is not None else local_device()
        check_same_model_on_all_ranks(module)
        swap_layers(module, self.layer_classes)
        module.to(self.param_dtype)
        for path, layer in module.named_modules():
            if isinstance(layer, CallbackLayer):
                layer.__dict__["wrapper"] = self  # a plain attribute, not a submodule
                layer.path = path
        self.module = module
        self.require_grad_sync = True
        self.grads_synced = None  # None: no backward yet; True: synced since the last one
        self.queue = None
        self.named_params = list(module.named_parameters())  # tied parameters appear once
        self.grads_of = {}
        self.optimizer = None  # set by the strategy's AdamW: it holds the fp32 masters
        self.clip_coef = 1.0

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
        if self.grads_synced is None:
            raise RuntimeError("optimizer step before any backward: run model(...) and "
                               "model.backward(loss) first")
        if self.require_grad_sync and not self.grads_synced:
            comm.where = "the gradient sync before the optimizer step"
            self.sync_grads()
            if self.queue is not None:
                self.queue.new_step()
            self.grads_synced = True

    def param_names(self):
        return {p: name for name, p in self.named_params}

    def backward(self, loss):
        """loss.backward(), with the loss scaled first under fp16."""
        if self.loss_scaler is not None:
            loss = loss * self.loss_scaler.scale
        loss.backward()

    def local_grads(self):
        grads = (self.grads_of.get(t) for t in self.optimizer_params())
        return [g for g in grads if g is not None]

    def master(self, tensor):
        """The fp32 value of an optimizer param: its master if it has one."""
        state = self.optimizer.state.get(tensor, {}) if self.optimizer is not None else {}
        return state["master"] if "master" in state else tensor.detach().float()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """Clip the grads to a global 2-norm of at most max_norm, as
        torch.nn.utils.clip_grad_norm_ does on the unsharded model; returns
        the norm before clipping (of the unscaled grads under fp16). The
        clipping coefficient is applied inside the optimizer's kernel, together
        with the loss scale, in the same pass that reads the grads."""
        self.finish_grad_sync()
        square_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in self.local_grads():
            square_sum += g.float().square().sum()
        if self.grads_sharded:
            comm.all_reduce(square_sum)  # each rank holds a disjoint part
        total_norm = square_sum.sqrt() / self.loss_scale()
        self.clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0).item()
        return total_norm.item()

    def loss_scale(self):
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def grad_scale(self):
        """What the optimizer multiplies the grads by: unscale and clip."""
        return self.clip_coef / self.loss_scale()

    @torch.no_grad()
    def found_overflow(self):
        """fp16: did any rank get an inf/nan grad? One all-reduce, so every
        rank agrees on skipping the step."""
        if self.loss_scaler is None:
            return False
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in self.local_grads():
            bad += (~torch.isfinite(g)).sum()
        comm.all_reduce(bad)
        return bad.item() > 0

    @torch.no_grad()
    def load_pieces(self, read):
        """Set every parameter this rank holds from read(piece): the fp32 values
        of elements [piece.lo, piece.hi) of parameter piece.name, flattened (a
        1-D tensor of piece.hi - piece.lo elements). Call it on every rank; each
        rank reads only what it holds. Checkpoints and pretrained weights load
        through it."""
        for piece in self.pieces():
            place = slice(piece.offset, piece.offset + piece.hi - piece.lo)
            values = read(piece)
            piece.tensor.detach().view(-1)[place].copy_(values)
            state = self.optimizer.state.get(piece.tensor, {}) if self.optimizer is not None else {}
            if "master" in state:
                state["master"].view(-1)[place].copy_(values)
        self.after_step()  # zero1/zero2: every rank's chunks into everyone's full parameters

    def full_state_dict(self):
        """Full fp32 values (the masters), keys as module.state_dict(), on every rank."""
        full = self.gather_full()
        return {k: full[v] if v in full else v.detach().float().cpu().clone()
                for k, v in self.module.state_dict(keep_vars=True).items()}


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


class StrategyAdamW(AdamW):
    wrapper = None  # the wrapper class this optimizer belongs to, set by each strategy

    def __init__(self, model, **hyper):
        if not isinstance(model, self.wrapper):
            raise TypeError(f"{type(self).__name__} steps a {self.wrapper.__name__}-wrapped model, "
                            f"got {type(model).__name__}: use the optimizer of the model's strategy "
                            "(tiny_zero.STRATEGIES[name])")
        self.model = model
        super().__init__([{"params": model.optimizer_params()}], **hyper)
        model.optimizer = self  # the wrapper reads the fp32 masters from here
        self.skipped_steps = 0

    @property
    def loss_scale(self):
        return self.model.loss_scale()

    def grad_of(self, param):
        return self.model.grads_of.get(param)

    def step(self):
        model = self.model
        model.finish_grad_sync()
        overflow = model.found_overflow()
        if model.loss_scaler is not None:
            model.loss_scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1  # every rank skips: the params stay as they are
            if model.rank == 0:
                log.warning("fp16 gradient overflow: step skipped (%d so far), loss scale now %g",
                            self.skipped_steps, model.loss_scale())
        else:
            self.grad_scale = model.grad_scale()  # 1/loss scale x clip coefficient
            super().step()
            model.after_step()
        model.clip_coef = 1.0

    def zero_grad(self):
        self.model.zero_grads()
