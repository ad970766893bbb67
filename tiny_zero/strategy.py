"""The base of every strategy: its layers' bookkeeping and its wrapper.

A strategy is a folder of three files:

    layers.py   <Name>Layer, a mixin of layer callbacks: what happens around a
                layer's math (gather before, free after, where each grad goes)
    wrapper.py  <Name>, the wrapper: what a rank holds, and the collectives
    optim.py    <Name>AdamW: optimizer.py's StrategyAdamW, pointed at that wrapper

One training step, as every strategy runs it:

    model(x)          each layer: StrategyLayer's bookkeeping, the mixin's
                      forward_callback, the layer's math (tiny_zero/module)
    loss.backward()   each layer's backward_callback; each parameter's grad goes
                      to the mixin's accumulate_grad, which adds it to a bucket
                      and sends a bucket once its grads are final. At the end of
                      the backward pass: reduce_grads(), and p.grad is set
    opt.step()        AdamW on model.shards with model.grads, per parameter
                      group; then sync_params()
    opt.zero_grad()   clear_grads()

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
first (comm.agree) and raise the same error.
"""
from contextlib import contextmanager
from itertools import compress
from operator import attrgetter

import torch
import torch.nn as nn

from . import comm
from .buckets import ParamSet
from .distributed import init_distributed, local_device
from .grads import TorchGrads
from .guards import ForwardedAttributes, check_not_wrapped, check_same_model_on_all_ranks, parameter_hash, \
    sequence_hash
from .holding import Holding
from .module import CallbackLayer, check_supported, expects_backward, in_backward_pass, recorded, swap_layers
from .module import layer_classes as module_layer_classes
from .precision import ClipAndScale, LossScaler, cast_floating_inputs, param_dtype
from .state_dicts import WrapperStateDicts, param_versions

REQUIRES_GRAD = attrgetter("requires_grad")  # read by map(), over many parameters in C


class StrategyLayer:
    """First in every strategy layer's classes (see layer_classes): what every
    strategy does around a layer, before its mixin. A forward that a backward
    will follow tells the wrapper which parameters will get grads; the first
    backward callback of a backward pass tells it a backward began;
    comm.where names the layer, for the error of a collective that hangs."""

    def forward_callback(self, ctx, x):
        comm.where = self.where_forward
        if expects_backward(ctx):
            self.wrapper.expect_grads(self, recorded(ctx))
        return super().forward_callback(ctx, x)

    def backward_callback(self, ctx, grad_out):
        comm.where = self.where_backward
        if not ctx.param_grads:  # before any collective of this pass: every rank raises alike
            raise RuntimeError(f"{self.path}: torch.autograd.grad (or backward(inputs=...)) through a strategy's "
                               "layers: each layer's backward hands its parameters' grads to the strategy, which "
                               "cannot leave them out as torch does; call loss.backward() (an input that requires "
                               "grad gets its x.grad) and keep the grads you need")
        if getattr(ctx, "backward_ran", False):  # before any collective of this pass: every rank raises alike
            raise RuntimeError(f"{self.path}: a second backward through the same forward (backward(retain_graph="
                               "True), then backward again): a strategy sends each layer's grads once per forward, "
                               "as torch DDP does; add the losses and call backward once, or run the forward again")
        ctx.backward_ran = True
        wrapper = self.wrapper
        if not wrapper.in_backward:  # the pass's first layer backward
            wrapper.backward_started()
        wrapper.skip_to(self)
        return super().backward_callback(ctx, grad_out)

    def _apply(self, fn, recurse=True):
        """What model.to(dtype or device), .half(), .double() and .cuda() run on
        each module: refused on a wrapped layer where it would change a
        parameter's dtype or device (fn is tried on an empty tensor like it).
        The wrapper's own conversion, at wrap time, comes before it is wrapped."""
        if "wrapper" in self.__dict__:
            for name, p in ((n, p) for n, p in self._parameters.items() if p is not None):
                converted = fn(torch.empty(0, dtype=p.dtype, device=p.device))
                if (converted.dtype, converted.device) != (p.dtype, p.device):
                    raise RuntimeError(f"{self.path}.{name}: converting the model after wrapping ({p.dtype} on "
                                       f"{p.device} to {converted.dtype} on {converted.device}) would leave the "
                                       "strategy stepping its own buffers while the module computes with the "
                                       "converted copies, which never train; convert the module before wrapping it "
                                       "(the wrapper's device= places it, mixed_precision= sets the dtype it "
                                       "computes in)")
        return super()._apply(fn, recurse)


def layer_classes(mixin):
    """A strategy's layers: for each tiny_zero layer, StrategyLayer, then the
    strategy's mixin, then the layer's math: Zero3Linear(StrategyLayer, Zero3Layer, Linear)."""
    return module_layer_classes(StrategyLayer, mixin)


class Wrapper(TorchGrads, Holding, ClipAndScale, WrapperStateDicts, ForwardedAttributes, nn.Module):
    """What every strategy's wrapper shares. A strategy sets layer_classes and
    fills in the hooks below; checks, the backward's bookkeeping, no_sync and
    the step's agreement are here; p.grad's conventions in grads.py, helpers
    for what a rank holds in holding.py, clipping and fp16 in precision.py,
    state dicts and pieces in state_dicts.py, model.<name> in guards.py."""

    layer_classes = None  # {torch layer class: this strategy's layer class}, from layer_classes(<Name>Layer)
    grads_replicated = False  # True: every rank holds the same averaged grads, whole (ddp)
    module_values_whole = True  # the module's parameters hold their whole values between steps (False: released, sliced)
    send = None  # zero3, fsdp: the collective of a bucket whose grads are final, for skip_to
    # True: nothing is sent from a step to the next backward (ddp): the step's
    # agreement goes out with that backward's, one round trip for both
    quiet_until_backward = False

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
        # data parallelism: this rank's index among the ranks that hold the same
        # parameters (all of them here; a pipeline stage's or a tensor slice's replicas)
        self.replica, self.replicas = self.rank, self.world_size
        self.replica_group = None  # the process group of those ranks (None: the world)
        self.device = torch.device(device) if device is not None else local_device()
        check_same_model_on_all_ranks(module)
        comm.open_side_channel()
        comm.agree("the wrapper's settings", wait=False,  # checked before its first collective
                   strategy=comm.value_hash(type(self).__name__), param_dtype=comm.value_hash(self.param_dtype),
                   reduce_dtype=comm.value_hash(self.reduce_dtype), loss_scaler=int(self.loss_scaler is not None))
        swap_layers(module, self.layer_classes)
        module.to(self.param_dtype)
        if self.param_dtype != torch.float32:
            module.register_forward_pre_hook(cast_floating_inputs(self.param_dtype), with_kwargs=True)
        layers = [(path, m) for path, m in module.named_modules() if isinstance(m, CallbackLayer)]
        for index, (path, layer) in enumerate(layers):
            layer.__dict__["wrapper"] = self  # a plain attribute, not a submodule
            layer.path, layer.index = path, index
            layer.where_forward, layer.where_backward = f"{path} forward", f"{path} backward"  # comm.where's
            layer.trained = [p for p in layer.parameters(recurse=False) if p.requires_grad]  # read once, as below
            layer.slots = []  # their indices in self.buckets, set with it
        self.callback_layers = [layer for _, layer in layers]
        self.module = module
        self.scale_entered = False  # fp16: the loss scale entered the backward running now (ScaleGrad)
        if self.loss_scaler is not None:
            module.register_forward_hook(self.scale_output)
        self.guard_module_state_dicts()  # model.module.state_dict() and load_state_dict() (state_dicts.py)
        self.named_params = list(module.named_parameters())  # tied parameters appear once
        self.name_of = {p: name for name, p in self.named_params}  # looked up when wrapping and in errors, not per step
        self.position = {p: i for i, (_, p) in enumerate(self.named_params)}  # the same
        self.shapes = {name: p.shape for name, p in self.named_params}  # full shapes, before any sharding
        self.trainable = [p for _, p in self.named_params if p.requires_grad]  # read once, here
        self.frozen = [p for _, p in self.named_params if not p.requires_grad]
        self.shards, self.working, self.grads = [], {}, {}  # the strategy fills these in
        self.host = []  # what a rank keeps in host memory, off its device (offload: what the step reads and writes)
        self.buckets = None
        self.require_grad_sync = True
        self.clip_coef = None  # a clip's coefficient, pending (a 0-d tensor on the grads' device)
        self.steps = 0  # optimizer steps taken
        self.backwards = 0  # backward passes since the last step
        self.in_backward = False
        self.used = []  # the layers used in forward since the last backward (their indices)
        self.averaged = set()  # data_ptr()s of the parts of model.grads that hold an average this step
        self.nothing = None  # the shared zero of released(), made at its first use
        self.released_views = {}  # parameter -> its released() view of that zero, made once
        self.in_flight = {}  # zero3, fsdp: unit -> its gather, started ahead of use
        self.order = None  # zero3, fsdp: the GatherOrder of their layers
        # by a trainable parameter's index in self.buckets (set with it, below):
        self.shown = []  # index -> what its p.grad shows (grad_attr), made once (None: not yet)
        self.showing = None  # ParamSet: the parameters whose p.grad backward_done set, until zero_grad
        self.assigned = {}  # index -> (its p.grad, version) set by the user, as a backward began
        self.versions = param_versions(self.named_params)  # in-place writes move them (adopt_param_writes)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "buckets" and value is not None:
            self.index_params(value)

    def index_params(self, buckets):
        """When the strategy sets self.buckets (once, having cut them): every
        trainable parameter's index is its place in them (Buckets.index), what
        each layer keeps of its own (layer.slots), and where the step's
        per-parameter state lives. From here on a step looks no parameter up
        by its hash."""
        for layer in self.callback_layers:
            layer.slots = buckets.indices(layer.trained)
        self.shown = [None] * len(buckets.params)
        self.showing = ParamSet(buckets)
        self.trainable_slots = buckets.indices(self.trainable)  # in self.trainable's order
        # what p.requires_grad must read at each step: True for the parameters the buckets hold
        self.checked = self.trainable + self.frozen
        self.requires = [id(p) in buckets.index for p in self.checked]

    # ------------------------------------------------------------ hooks

    def reduce_grads(self):
        """The end of a backward pass outside no_sync(): send what backward did
        not, wait for every collective in flight, and add the averages into
        model.grads."""
        raise NotImplementedError

    def clear_grads(self, set_to_none):
        """zero_grad(): drop (or zero) the local bucket grads and model.grads."""
        raise NotImplementedError

    def grad_attr(self, param):
        """What p.grad shows once param has a grad: a view of its averaged grad
        where a rank holds it whole, else a ShardedGrad that raises when used."""
        raise NotImplementedError

    def pieces(self):
        """[Piece]: where this rank's part of each parameter lives."""
        raise NotImplementedError

    def gather_full(self):
        """{parameter: its full fp32 value, on the CPU}; a collective where
        parameters are sharded."""
        raise NotImplementedError

    def sync_params(self):
        """After the shards changed (an optimizer step, a load): make the
        parameters the layers compute with match them."""
        raise NotImplementedError

    # ------------------------------------------------------------ helpers for strategies

    def settle(self):
        """Leave nothing gathered or in flight that a later use could mistake
        for current values: called at the end of every backward pass and
        before every step. Nothing to do unless a strategy gathers ahead
        (zero3 and fsdp extend it)."""

    # ------------------------------------------------------------ one step's bookkeeping

    def forward(self, *args, **kwargs):
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
        self.buckets.forward_uses(layer.slots, recorded)
        if recorded:
            self.used.append(layer.index)

    def skip_to(self, layer):
        """zero3, fsdp: `layer`'s backward begins where the recorded order
        expected others' first: their output reached no loss on this rank (a
        head in some ranks' loss only). Do what their backward sends on the
        ranks where it ran: gather, free, and send their buckets once their
        uses are counted done (with zeros where no grad came)."""
        order = self.order
        if order is None or not order.backward:  # not after a layer's backward of this pass
            return
        skipped = order.next_layer()
        while skipped is not None and skipped is not layer and layer in order.order[:order.position - 1]:
            self.unshard(skipped, backward=True)
            for bucket in self.buckets.skip(skipped.trained, send=self.require_grad_sync):
                self.send(bucket)
            self.reshard(skipped)
            skipped = order.next_layer()

    def backward_started(self):
        """The first layer backward of a backward pass: every rank agrees it
        runs the same backward (the same step, forward layers and no_sync),
        before any collective of it; the end of the pass is queued."""
        if self.in_backward:
            return
        if self.loss_scaler is not None and not self.scale_entered:  # before any collective: every rank raises alike
            raise RuntimeError("fp16: this backward does not start from the model's output, where the loss scale "
                               "enters (a loss from a submodule's output, model.module.transformer(x)?): its grads "
                               "would reach the optimizer unscaled, and it divides them by the scale. Compute the "
                               "loss from model(...) (or model.module(...))")
        self.before_backward()
        comm.agree("this backward pass", wait=False,  # checked before its first collective
                   step=self.steps, backward=self.backwards, no_sync=int(not self.require_grad_sync),
                   layers_used_in_forward=sequence_hash(self.used))
        self.in_backward = True
        self.syncing = self.require_grad_sync
        self.used.clear()
        self.backwards += 1
        torch.autograd.Variable._execution_engine.queue_callback(self.backward_done)  # at the pass's end

    def before_backward(self):
        """What was done to the grads since the last backward, taken in as
        torch has it before this one adds to them: a p.grad set to None
        clears that grad, one assigned is remembered, a clip is applied."""
        self.forget_cleared_grads()
        self.remember_assigned_grads()
        self.apply_clip()  # grads kept from before a clip (no zero_grad) add up clipped, as torch's

    def backward_done(self):
        comm.where = "the end of the backward pass"
        self.in_backward = False
        self.scale_entered = False
        self.buckets.add_held()  # through their hooks
        self.settle()
        self.refuse_grads_from_autograd()  # before the collectives: every rank raises alike
        if self.syncing:
            self.reduce_grads()  # the strategy: wait, average into model.grads
            got = self.buckets.got_grad
            for i in compress(range(len(self.shown)), got.marks):
                p = self.buckets.params[i]
                if p.grad is None:
                    p.grad = self.shown_at(i)
            self.showing.update(got)
        self.buckets.end_backward()

    def stepping(self, written):
        """The parameters the optimizer steps now: those whose p.grad is set,
        as torch.optim (zero_grad(set_to_none=True), or no grad in any backward
        since, leaves it None). Every rank agrees on them, and on how many
        parameters were `written` in place (param_writes) since the last step."""
        self.forget_cleared_grads()
        if list(map(REQUIRES_GRAD, self.checked)) != self.requires:  # what this rank holds (a stage: its own)
            p = next(p for p, wanted in zip(self.checked, self.requires) if p.requires_grad != wanted)
            raise RuntimeError(f"{self.name_of[p]}.requires_grad changed after the model was wrapped: tiny_zero "
                               "reads it once, when wrapping, to decide what is sent and stepped; set it before "
                               "wrapping")
        buckets, got = self.buckets, self.buckets.got_grad.marks
        stepping = []
        for i in self.trainable_slots:
            p = buckets.params[i]
            grad = p.grad
            if grad is None:
                continue
            if not got[i]:
                self.refuse_foreign_grad(p)
            if grad is not self.shown_at(i):
                self.take_assigned_grad(self.name_of[p], p)
            stepping.append(p)
        for p in self.frozen:
            if p.grad is not None:
                self.refuse_foreign_grad(p)
        missing = buckets.missing()  # got a grad on another rank, or none
        if missing and self.quiet_until_backward:  # the check below waits for the next backward: tell by the values
            stepping += self.got_elsewhere(missing, stepping, everyone_missed=None)
            missing = []
        spread = comm.agree("the optimizer step", group=self.replica_group, wait=bool(missing), step=self.steps,
                            defer=self.quiet_until_backward,
                            parameters=parameter_hash(buckets, stepping + missing),
                            parameters_written_in_place=len(written), grads_missing=comm.Spread(len(missing)),
                            grads_missing_named=comm.Spread(parameter_hash(buckets, missing)))
        if missing:
            (fewest, _), (low, high) = spread["grads_missing"], spread["grads_missing_named"]
            stepping += self.got_elsewhere(missing, stepping, everyone_missed=fewest > 0, all_alike=low == high)
        self.buckets.expected.clear()  # the next step expects the grads of forwards after this one
        return stepping
