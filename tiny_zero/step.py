"""The step every strategy runs, and the moments of it that a strategy fills in.

A strategy is a folder of three files:

    layers.py   <Name>Layer, the layer's moments: before_layer, after_layer
                (gather before the math, free after), grad_ready (where each grad goes)
    wrapper.py  <Name>, the wrapper: what a rank holds; its moments
                after_backward and sync_params; the collectives they send
    optim.py    <Name>AdamW: optimizer.py's StrategyAdamW, pointed at that wrapper

One training step, its moments (in the folder) and every collective it sends:

    model(x)          each layer: StrategyLayer.forward_callback; before_layer
                      (zero3, fsdp: gather the unit), the layer's math
                      (tiny_zero/module), after_layer (zero3, fsdp: free)
    loss.backward()   the first layer's backward: backward_started, the
                      ranks' agreement on this backward (agreements.agree, sent
                      alongside); each layer: before_layer, its math,
                      grad_ready for each parameter (the grad into its bucket;
                      ddp, zero2, zero3, fsdp, offload: send a bucket whose grads
                      are final), after_layer
    (backward ends)   backward_done: after_backward (send the rest, wait,
                      average into model.grads), then p.grad is set
    clip_grad_norm_   the all-reduce of the grads' squared norm, where a rank
                      holds only part of them (optimizer.py)
    opt.step()        optimizer.py: free_gathered (zero3, fsdp: nothing stays
                      gathered); stepping (grads.py), the ranks' agreement on the
                      parameters that step; fp16: the all-reduce of the
                      overflow flag; AdamW on model.shards with model.grads,
                      per parameter group; sync_params (zero1, zero2,
                      offload: all-gather the updated chunks)
    opt.zero_grad()   clear_grads()

What keeps torch's conventions (p.grad, zero_grad, in-place writes, state
dicts, hooks, torch's Join) is in files a first reader may skip: grads.py,
state_dicts.py, guards.py, module/hooks.py, join.py.

Gradients, one vocabulary:

    grad          a gradient this rank's backward computed (local, its batch only)
    bucket.grads  the local grads of one bucket's parameters, flat, to be sent
    model.grads   {shard: its averaged grad}: what the optimizer steps with. They
                  add up over backward passes until zero_grad(), as p.grad in torch

The wrapper follows torch's training loop: a frozen parameter (requires_grad
False when wrapped) is never sent or stepped; a parameter whose p.grad is None
is not stepped and keeps its step count; each backward outside no_sync()
averages, and the averages add up; param groups and lr schedulers work as in
torch.optim. Ranks that are about to run different collectives find out
first (agreements.agree) and raise the same error.
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Joinable

from . import agreements, comm
from .guards import (ConversionGuard, ShardedGrad, check_backward_once, check_scale_entered, forwarded_getattr,
                     sequence_hash)
from .holding import broadcast_buffers
from .hooked import HookedLayer
from .module import DEFAULT_CLASSES, expects_backward, in_backward_pass, recorded
from .wrapping import Wrapping


class StrategyLayer(ConversionGuard):
    """First in every strategy layer's classes (see layer_classes): what every
    strategy does around a layer, before its mixin. A forward that a backward
    will follow tells the wrapper which parameters will get grads; the first
    backward callback of a backward pass tells it a backward began;
    comm.where names the layer, for the error of a collective that hangs."""

    def forward_callback(self, ctx, x):
        comm.where = self.where_forward
        backward_follows = expects_backward(ctx)
        if backward_follows:
            self.wrapper.expect_grads(self, recorded(ctx))
        self.before_layer(backward_follows=backward_follows, backward=False)  # moment: before a layer computes
        y = super().forward_callback(ctx, x)  # the layer's math (tiny_zero/module/layers.py)
        self.after_layer()  # moment: after it computed
        return y

    def backward_callback(self, ctx, grad_out):
        comm.where = self.where_backward
        check_backward_once(ctx, self.path)  # before any collective of this pass: every rank raises alike
        wrapper = self.wrapper
        if not wrapper.in_backward:  # the pass's first layer backward
            wrapper.backward_started()
        wrapper.skip_to(self)
        self.before_layer(backward_follows=False, backward=True)  # moment: before a layer computes, in backward
        grad_in = super().backward_callback(ctx, grad_out)  # the math; each parameter's grad: grad_ready(param, grad)
        self.after_layer()  # moment: after it computed
        return grad_in


class LayerMoments:
    """A layer's moments in a step, which a strategy's mixin (its layers.py)
    fills in; here, what a moment does where the mixin leaves it out.

        before_layer   forward, and again backward: before the layer's math
        after_layer    after it
        grad_ready     a parameter's grad of this layer is computed (the
                       mixin always fills it in: where the grad goes)"""

    def before_layer(self, backward_follows, backward):
        """backward_follows: a backward may follow this forward (False in backward itself)."""

    def after_layer(self):
        pass


def place_in_flat_grads(layer, ctx, param, dtype):
    """grad_place of a strategy whose grads persist in one flat buffer (ddp,
    zero1): a grad is computed straight into its place there while that holds
    none (Buckets.fresh_place); not under autocast, whose ops pick their dtype."""
    return None if ctx.autocast else layer.wrapper.buckets.fresh_place(param, dtype)


def layer_classes(*classes):
    """{kind: class}, what swap_layers() and find_layers take, for a strategy's
    layer classes, written out in its layers.py: one per tiny_zero layer
    (Zero3Linear(StrategyLayer, Zero3Layer, LayerMoments, Linear): around the
    math, StrategyLayer, then the strategy's mixin, then its moments'
    defaults), and one, under the key HookedLayer, with the same moments for
    every other module that holds parameters (hooked.py):
    Zero3Hooked(HookedLayer, Zero3Layer, LayerMoments)."""
    kind_of = {layer: kind for kind, layer in DEFAULT_CLASSES.items()}
    out = {}
    for cls in classes:
        kinds = [HookedLayer] if issubclass(cls, HookedLayer) else [kind_of[b] for b in cls.__bases__ if b in kind_of]
        out[kinds[0]] = cls
    missing = [getattr(k, "__name__", k) for k in [*DEFAULT_CLASSES, HookedLayer] if k not in out]
    if missing:
        raise TypeError(f"layer_classes: no class given for {missing}: a strategy writes one class per tiny_zero "
                        "layer (module/swap.py: DEFAULT_CLASSES) and one for hooked modules")
    return out


class Wrapper(Wrapping, Joinable, nn.Module):
    """What every strategy's wrapper shares. A strategy sets layer_classes and
    fills in the moments below (and zero_grad's clear_grads, p.grad's
    grad_attr, the state dicts' pieces and full_values); the backward's
    bookkeeping, no_sync, model.grads and the step's agreement are here.
    Apart: the wrap-time setup in wrapping.py, p.grad's conventions in
    grads.py (model.torch_grads), what a rank holds in holding.py, the
    clip in optimizer.py (model.clipping), fp16's scale in precision.py,
    state dicts in state_dicts.py (model.state_dicts), model.<name> in
    guards.py, torch's Join in join.py (model.joining)."""

    layer_classes = None  # {torch layer class: this strategy's layer class}: its layers.py's LAYER_CLASSES
    grads_replicated = False  # True: every rank holds the same averaged grads, whole (ddp)
    params_whole_between_steps = True  # the module's parameters hold their whole values between steps (False: released, sliced)
    send_bucket = None  # the collective of a bucket whose grads are final (zero2, zero3, fsdp, offload)
    # True: nothing is sent from a step to the next backward (ddp): the step's
    # agreement goes out with that backward's, one round trip for both
    defer_step_agreement = False
    __getattr__ = forwarded_getattr  # model.<name>: what nn.Module finds, then what guards.py forwards

    # ------------------------------------------------------------ the wrapper's moments

    def after_backward(self):
        """Moment: the end of a backward pass outside no_sync(). Send what
        backward did not, wait for every collective in flight, and add the
        averages into model.grads."""
        raise NotImplementedError

    def sync_params(self):
        """Moment: after the optimizer step (and after a load): make the
        parameters the layers compute with match the shards it stepped."""
        raise NotImplementedError

    # ------------------------------------------------------------ p.grad (grads.py: TorchGrads)

    def clear_grads(self, set_to_none):
        """zero_grad(): drop (or zero) the local bucket grads and model.grads."""
        raise NotImplementedError

    def grad_attr(self, param):
        """What p.grad shows once param has a grad: a view of its averaged grad
        where a rank holds it whole, else a ShardedGrad that raises when used."""
        raise NotImplementedError

    def sharded_grad(self, param):
        """What p.grad shows where the averaged grad is sharded (grad_attr)."""
        return ShardedGrad(param, type(self).__name__)

    def zero_grad(self, set_to_none=True, params=None):
        """nn.Module's, as torch's, of every parameter or those in `params` (TorchGrads.zero_grad)."""
        self.torch_grads.zero_grad(set_to_none, params)

    def stepping(self, written):
        """The parameters the optimizer steps now (TorchGrads.stepping; zero1 adds a check)."""
        return self.torch_grads.stepping(written)

    # ------------------------------------------------------------ state dicts (model.state_dicts: state_dicts.py)

    def pieces(self):
        """[Piece]: where this rank's part of each parameter lives."""
        raise NotImplementedError

    def full_values(self):
        """{parameter: its full fp32 value, on the CPU}; a collective where
        parameters are sharded."""
        raise NotImplementedError

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """Full fp32 values, keys as torch DDP's ("module.x"): StateDicts.state_dict."""
        return self.state_dicts.state_dict(destination, prefix)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Every rank's pieces, the masters and the buffers: StateDicts.load_state_dict."""
        return self.state_dicts.load_state_dict(state_dict, strict)

    def full_state_dict(self, prefix=""):
        """Full fp32 values, keys as the module's: StateDicts.full_state_dict."""
        return self.state_dicts.full_state_dict(prefix)

    def load_pieces(self, read, names=None):
        """Each rank sets what it holds from read(piece): StateDicts.load_pieces."""
        self.state_dicts.load_pieces(read, names)

    def pieces_to_save(self):
        """What this rank writes to a checkpoint: StateDicts.pieces_to_save."""
        return self.state_dicts.pieces_to_save()

    # ------------------------------------------------------------ helpers for strategies

    def queue_finish(self, bucket, handle, dest, out):
        """A bucket's collective just started (handle None: nothing sent; its sum
        arrives in out, for dest in model.grads, None: kept elsewhere). Finish the
        one started before it, which ran while this bucket's grads were computed."""
        self.unfinished.append((bucket, handle, dest, out))
        if len(self.unfinished) > 1:
            self.finish(*self.unfinished.pop(0))

    @torch.no_grad()
    def finish_sends(self):
        """after_backward, where backward sends each bucket as its grads are
        final: send what it did not (parameters used no more), finish all."""
        for bucket in self.buckets.unsent():
            self.send_bucket(bucket)
        while self.unfinished:
            self.finish(*self.unfinished.pop(0))

    # model.grads, where a strategy's finish puts the averages (zero2, zero3, fsdp)

    def reduce_target(self, dest):
        """Where a collective writes dest's sum: dest if it holds nothing this step, else a new buffer."""
        return dest if dest.data_ptr() not in self.grads_written else torch.empty_like(dest)

    def add_to_grads(self, dest, average):
        """dest = average the first time in a step, dest += average after (the
        averages add up over backward passes, as p.grad does; reduce_target)."""
        if dest.data_ptr() in self.grads_written:
            dest.add_(average)
        elif average is not dest:
            dest.copy_(average)
        self.grads_written.add(dest.data_ptr())

    def grads_for(self, shard):
        """model.grads[shard] of a strategy that makes them as grads come
        (zero3, fsdp): made at a step's first send, freed by zero_grad (drop_grads)."""
        if shard not in self.grads:
            self.grads[shard] = torch.zeros_like(shard, dtype=self.reduce_dtype)
        return self.grads[shard]

    def drop_grads(self, set_to_none):
        """zero_grad of model.grads made at a step's first reduce: freed, or zeroed."""
        if set_to_none:
            self.grads = {}  # the next reduce makes them again
        else:
            for g in self.grads.values():
                g.zero_()

    def free_gathered(self):
        """Leave nothing gathered or in flight that a later use could mistake
        for current values: called at the end of every backward pass and
        before every step. Nothing to do unless a strategy gathers ahead
        (zero3 and fsdp: units.Unsharding)."""

    def skip_to(self, layer):
        """zero3, fsdp (units.Unsharding): catch up with layers whose backward did not run on this rank."""

    def grad_square_sum(self):
        """The clip's sum of the squares of the averaged grads, each counted once (optimizer.py: Clipping)."""
        return self.clipping.grad_square_sum()

    def where_the_step_runs(self, *values):
        """The step's scale and skip, on the device of the shards it steps:
        where they are made (offload moves them to the host)."""
        return values

    # ------------------------------------------------------------ one step's bookkeeping

    def forward(self, *args, **kwargs):
        if self._join_config.enable:  # inside torch's Join: ranks that ran out shadow this iteration (join.py)
            self.joining.notify(args, kwargs)
        if self.buffers_to_sync and self.sync_buffers:
            broadcast_buffers(self)  # as torch DDP's broadcast_buffers: the first forward, and one after a
        self.sync_buffers = self.require_grad_sync and torch.is_grad_enabled()  # forward that trained outside no_sync
        return self.module(*args, **kwargs)

    def backward(self, loss):
        """loss.backward(); kept for the API (under fp16 the scaling is in forward)."""
        loss.backward()

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate grads locally; the first backward
        outside sends the sum."""
        self.require_grad_sync = False
        try:
            yield
        finally:
            self.require_grad_sync = True

    def expect_grads(self, layer, recorded):
        """A layer's forward that a backward may follow. The ranks agree on the
        layers of recorded forwards only: one under no_grad may be an
        evaluation on one rank (a reentrant checkpoint's, which backward
        recomputes, is one too), whose uses only hold its buckets back."""
        if self.in_backward and not in_backward_pass():
            self.in_backward = False  # a backward that raised never reached backward_done
        self.buckets.forward_uses(layer.param_indices, recorded)
        if recorded:
            self.used.append(layer.index)

    def backward_started(self):
        """The first layer backward of a backward pass: every rank agrees it
        runs the same backward (the same step, forward layers and no_sync),
        before any collective of it; the end of the pass is queued."""
        if self.in_backward:
            return
        check_scale_entered(self)  # fp16; before any collective: every rank raises alike
        self.before_backward()
        agreements.agree("this backward pass", wait=False,  # checked before its first collective
                   step=self.steps, backward=self.backwards, no_sync=int(not self.require_grad_sync),
                   layers_used_in_forward=sequence_hash(self.used))
        self.in_backward = True
        self.syncs_this_backward = self.require_grad_sync
        self.used.clear()
        self.backwards += 1
        torch.autograd.Variable._execution_engine.queue_callback(self.backward_done)  # at the pass's end

    def before_backward(self):
        """What was done to the grads since the last backward, taken in as
        torch has it before this one adds to them: a p.grad set to None
        clears that grad, one assigned is remembered, a clip is applied."""
        self.torch_grads.forget_cleared_grads()
        self.torch_grads.remember_assigned_grads()
        self.clipping.apply()  # grads kept from before a clip (no zero_grad) add up clipped, as torch's

    def backward_done(self):
        comm.where = "the end of the backward pass"
        self.in_backward = False
        self.scale_entered = False
        self.running.clear()  # a hooked module held gathered to the pass's end (hooked.py) lets go
        self.buckets.add_held()  # through their hooks
        self.free_gathered()
        self.torch_grads.refuse_grads_from_autograd()  # before the collectives: every rank raises alike
        if self.syncs_this_backward:
            self.after_backward()  # moment: the strategy waits, and averages into model.grads
            self.torch_grads.show(self.buckets.got_grad)  # p.grad is set
        self.buckets.end_backward()

    # ------------------------------------------------------------ what users and torch call, done in what it holds

    @property
    def loss_scale(self):
        """fp16's loss scale now, a number (a host read: for the user, never the step; precision.py's LossScaler)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def clip_grad_norm_(self, max_norm):
        """torch's clip_grad_norm_ on the unsharded model; returns the norm before clipping (optimizer.py: Clipping)."""
        return self.clipping.clip_grad_norm_(max_norm)

    def join_hook(self, divide_by_initial_world_size=True, **kwargs):
        """torch's Join: the hook that shadows the others' iterations once this rank ran out (join.py: Joining)."""
        return self.joining.hook(divide_by_initial_world_size)

    @property
    def join_device(self):
        """torch's Join: where its all-reduces run."""
        return self.device

    @property
    def join_process_group(self):
        """torch's Join: the ranks its all-reduces span."""
        return dist.group.WORLD
