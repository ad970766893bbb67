"""The base of every strategy: its layers' bookkeeping, its wrapper, its optimizer.

A strategy is a folder of three files:

    layers.py   <Name>Layer, a mixin of layer callbacks: what happens around a
                layer's math (gather before, free after, where each grad goes)
    wrapper.py  <Name>, the wrapper: what a rank holds, and the collectives
    optim.py    <Name>AdamW: this file's StrategyAdamW, pointed at that wrapper

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
import functools
from collections import namedtuple
from contextlib import contextmanager
from itertools import compress, groupby, repeat
from operator import attrgetter, is_, is_not

import torch
import torch.nn as nn

from . import comm
from .comm import ParamSet
from .distributed import init_distributed, local_device
from .guards import ShardedGrad, check_not_wrapped, check_same_model_on_all_ranks, parameter_hash
from .materialize import full_value, set_data
from .module import CallbackLayer, check_supported, expects_backward, in_backward_pass, recorded, swap_layers
from .module import layer_classes as module_layer_classes
from .optim import adamw_update_
from .optim.adamw import check_group, check_hparams, check_options
from .precision import LossScaler, cast_floating_inputs, param_dtype
from .state_dicts import OptimizerStateDicts, WrapperStateDicts, param_versions


# Elements [lo, hi) of parameter `name` (flattened; full shape `shape`) are
# held by this rank at tensor[offset:offset + hi - lo], where `tensor` is one
# of model.shards (1-D fp32: what the optimizer steps) or, for a frozen
# parameter, its own storage. `replicated`: every replica (model.replicas)
# holds the same piece.
Piece = namedtuple("Piece", "name shape lo hi tensor offset replicated")
GRAD, REQUIRES_GRAD = attrgetter("grad"), attrgetter("requires_grad")  # read by map(), over many parameters in C


def sequence_hash(numbers):
    """One int64 that tells sequences of small integers apart (their order too)."""
    h = 0
    for n in numbers:
        h = (h * 31 + n + 1) % (1 << 61)
    return h


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


class Wrapper(WrapperStateDicts, nn.Module):
    """What every strategy's wrapper shares. A strategy sets layer_classes and
    fills in the hooks below; the rest (checks, precision, the backward's
    bookkeeping, no_sync, clipping, state dicts) is here."""

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

    def value(self, name, param):
        """The full value of `param` on this rank's device: its own data, or
        the model's init for a parameter built on meta."""
        return full_value(self.module, name, param, self.device)

    def released(self, param):
        """What a parameter holds while this rank keeps none of it: its full
        shape over a single shared zero, so p.shape and p.dim() stay true (for
        param groups built after wrapping) and nothing is allocated; writing
        into it fails."""
        if param not in self.released_views:
            if self.nothing is None:
                self.nothing = torch.zeros((), dtype=self.param_dtype, device=self.device)
            self.released_views[param] = self.nothing.expand(self.shapes[self.name_of[param]])
        return self.released_views[param]

    def fp32_shards(self, tensors):
        """The fp32 tensors the optimizer steps for these flat tensors of
        parameters: the tensors themselves in fp32, else fp32 masters (the
        optimizer writes the low-precision copy back in the same pass)."""
        if self.param_dtype == torch.float32:
            return list(tensors)
        masters = [t.detach().float() for t in tensors]
        self.working.update(zip(masters, tensors))
        return masters

    def flatten(self, buckets, params):
        """One flat buffer holding `params` in the buckets' layout; each
        parameter becomes a view of it. Rank 0's values, on every rank."""
        flat = torch.zeros(sum(b.numel for b in buckets), dtype=self.param_dtype, device=self.device)
        name_of = self.param_names()
        for p in params:
            bucket = next(b for b in buckets if p in b.offsets)
            view = bucket.view(flat, p)
            view.copy_(self.value(name_of[p], p))
            self.set_data(p, view)
        self.broadcast_from_first_replica(flat)
        return flat

    def keep_whole(self, params):
        """Parameters every rank keeps whole and never steps (frozen ones under
        ddp, zero1, zero2): on this device, rank 0's values."""
        name_of = self.param_names()
        for p in params:
            value = self.value(name_of[p], p)
            self.broadcast_from_first_replica(value)
            self.set_data(p, value)

    def broadcast_from_first_replica(self, tensor):
        """Every replica takes the first one's values (replicas are consecutive
        ranks; here the world, whose first is rank 0): all start alike."""
        comm.broadcast(tensor, src=self.rank - self.replica, group=self.replica_group)

    def reduce_target(self, dest):
        """Where a collective should write the sum for `dest` (part of
        model.grads): dest itself if it holds nothing this step, else a new buffer."""
        return dest if dest.data_ptr() not in self.averaged else torch.empty_like(dest)

    def average_into(self, dest, average):
        """dest = average (a collective's sum of grads divided by N, Buckets)
        the first time in a step, dest += average after: the averaged grads
        add up over backward passes, as p.grad does in torch. Where
        reduce_target let the collective write into dest, it is there already."""
        if dest.data_ptr() in self.averaged:
            dest.add_(average)
        elif average is not dest:
            dest.copy_(average)
        self.averaged.add(dest.data_ptr())

    def bucket_pieces(self, bucket, begin, n, tensor, offset=0):
        """Pieces of the parameters of `bucket` (a flat layout) whose elements
        fall in [begin, begin + n) of it, held at tensor[offset:offset + n]."""
        pieces, names = [], self.param_names()
        for p in bucket.params:
            start = bucket.offsets[p]
            lo, hi = max(start, begin), min(start + bucket.shapes[p].numel(), begin + n)
            if lo < hi:
                pieces.append(Piece(names[p], bucket.shapes[p], lo - start, hi - start, tensor,
                                    offset + lo - begin, False))
        return pieces

    def whole_pieces(self, params, replicated=True):
        """Pieces of parameters held whole, in their own storage (by every
        rank, or, not replicated, by this one)."""
        names = self.param_names()
        return [Piece(names[p], p.shape, 0, p.numel(), p.data.view(-1), 0, replicated) for p in params]

    def gather_bucket(self, bucket, chunk):
        """{parameter: full fp32 value on the CPU} for a bucket of which every
        rank holds a 1/N chunk (fp32): one all_gather."""
        flat = torch.empty(bucket.numel, dtype=torch.float32, device=self.device)
        comm.all_gather(flat, chunk.to(self.device))  # a chunk kept in host memory (offload) goes by the device
        return {p: bucket.own_view(flat, p).cpu().clone() for p in bucket.params}

    def settle(self):
        """Leave nothing gathered or in flight that a later use could mistake
        for current values: called at the end of every backward pass and
        before every step. Nothing to do unless a strategy gathers ahead
        (zero3 and fsdp extend it)."""

    def shard_grads(self):
        """model.grads of a strategy with one shard (zero3): made at a step's
        first reduce, and freed by zero_grad (drop_grads)."""
        if not self.grads:
            self.grads = {self.shards[0]: torch.zeros_like(self.shards[0], dtype=self.reduce_dtype)}
        return self.grads[self.shards[0]]

    def drop_grads(self, set_to_none):
        """zero_grad of model.grads made at a step's first reduce: freed, or zeroed."""
        if set_to_none:
            self.grads = {}  # the next reduce makes them again
        else:
            for g in self.grads.values():
                g.zero_()

    def chunk_pieces(self):
        """pieces() where every rank holds the N-th chunk of each bucket as
        model.shards[bucket.index] (zero1, zero2, offload), and frozen
        parameters whole."""
        chunks = [piece for bucket, shard in zip(self.buckets, self.shards)
                  for piece in self.bucket_pieces(bucket, self.rank * shard.numel(), shard.numel(), shard)]
        return chunks + self.whole_pieces(self.frozen)

    def gather_chunks(self):
        """{parameter: full fp32 value on the CPU} where every rank holds the
        N-th chunk of each bucket as model.shards[bucket.index] (zero1, zero2,
        offload), and frozen parameters whole."""
        full = {p: p.detach().float().cpu().clone() for p in self.frozen}
        for bucket, shard in zip(self.buckets, self.shards):
            full.update(self.gather_bucket(bucket, shard))  # the fp32 masters, not the low-precision copy
        return full

    def set_data(self, param, value):
        """Point param at value, when wrapping (see tiny_zero/materialize.py:
        meta parameters too, whose swapped contents come with a new version
        counter: what adopt_param_writes compares with is read again)."""
        set_data(param, value)
        self.versions[self.position[param]] = param._version

    def sharded_grad(self, param):
        """What p.grad shows where the averaged grad is sharded (grad_attr)."""
        return ShardedGrad(param, type(self).__name__)

    def param_names(self):
        return self.name_of

    def all_pieces(self):
        if not hasattr(self, "_pieces"):
            self._pieces = self.pieces()
        return self._pieces

    def pieces_to_save(self):
        """The pieces this rank writes to a checkpoint, so that each element is
        written once: those it alone holds, and its round-robin share of those
        every replica holds."""
        self.adopt_param_writes()
        pieces = self.pieces()
        replicated = [p for p in pieces if p.replicated]
        return [p for p in pieces if not p.replicated] + replicated[self.replica::self.replicas]

    # ------------------------------------------------------------ one step's bookkeeping

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # What model.<name> finds on the wrapped module, as DeepSpeed's engine
    # forwards it: only what reads no parameter outside a forward (generate's
    # forwards run through the strategy's layers), since a rank may hold only
    # its part of a parameter. Anything else the module has: model.module.<name>.
    FORWARDED = ("generate", "config", "generation_config", "can_generate", "main_input_name",
                 "gradient_checkpointing_enable", "gradient_checkpointing_disable", "enable_input_require_grads")

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules (model.module)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or not hasattr(module, name):
                raise
        if name == "generate" and not self.module_values_whole and self.world_size > 1:
            # every forward sends collectives: a rank whose sequences have ended
            # runs forwards on until every rank's have (Hugging Face's synced_gpus)
            return functools.partial(module.generate, synced_gpus=True)
        if name in self.FORWARDED:
            return getattr(module, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}; the wrapped module has: use "
                             f"model.module.{name}, on every rank alike (outside a forward, a parameter may hold "
                             "only this rank's part)")

    def scale_output(self, module, args, out):
        """fp16, a forward hook of the module: grads are scaled from where they
        enter the model, so loss.backward() and model.backward(loss) are the
        same, and model(x) and model.module(x) too."""
        if not torch.is_grad_enabled():
            return out
        return torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: ScaleGrad.apply(t, self) if t.requires_grad else t, out)

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

    def shown_grad(self, p):
        return self.shown_at(self.buckets.index[id(p)])

    def shown_at(self, i):
        """What p.grad shows for the trainable parameter at index i, made once."""
        shown = self.shown[i]
        if shown is None:
            shown = self.shown[i] = self.grad_attr(self.buckets.params[i])
        return shown

    def zero_grad(self, set_to_none=True, params=None):
        """As torch's: p.grad None (or zero), and the wrapper's grads with it,
        for every parameter or those in `params` (an optimizer's: others keep
        accumulating, as in torch)."""
        params = [p for _, p in self.named_params] if params is None else list(params)
        if set_to_none:
            for p in params:
                p.grad = None
        else:
            for p in params:
                if p.grad is not None and not isinstance(p.grad, ShardedGrad):
                    p.grad.zero_()
        slots = set(self.buckets.indices(params))
        if len(slots) == len(self.shown):  # every trainable parameter
            self.clip_coef = None  # nothing left to clip
            self.clear_grads(set_to_none)
            self.buckets.clear(keep_got_grad=not set_to_none)
            if set_to_none:
                self.showing.clear()
                self.averaged.clear()
        else:
            if set_to_none:
                for i in slots:
                    self.showing.marks[i] = 0
            self.clear_some_grads(params, slots, set_to_none)

    def forget_cleared_grads(self):
        """A p.grad that backward set and that was set to None since, outside
        zero_grad() (model.module.zero_grad(), or `p.grad = None`, torch's cheap
        zero_grad), clears that grad as in torch: the wrapper's own copy of it
        goes too, which the next backward would otherwise add to."""
        if not self.showing:  # zero_grad() since the last backward: nothing shown
            return
        shown = list(self.showing)
        if all(map(is_not, map(GRAD, shown), repeat(None))):  # the test, one pass in C: none cleared
            return
        self.zero_grad(params=[p for p in shown if p.grad is None])

    def remember_assigned_grads(self):
        """The p.grad tensors that the wrapper did not make, as a backward
        begins (assigned by the user: ddp steps with them, as torch would)."""
        grads = list(map(GRAD, self.buckets.params))
        if all(map(is_, grads, repeat(None))) or all(map(is_, grads, self.shown)):  # the usual: none assigned
            self.assigned = {}
            return
        self.assigned = {i: (grad, grad._version) for i, (grad, shown) in enumerate(zip(grads, self.shown))
                         if grad is not None and grad is not shown}

    def refuse_grads_from_autograd(self):
        """A p.grad that autograd made or added to in this backward: the
        parameter was used outside its layer (F.linear(x, layer.weight),
        x * norm.weight), where no strategy sees its grad, and it would be
        stepped without it (zero3 and fsdp even computed with a released
        parameter there)."""
        grads = list(map(GRAD, self.buckets.params))
        if all(map(is_, grads, repeat(None))) or all(map(is_, grads, self.shown)):  # the usual, one pass in C
            return
        for i in self.trainable_slots:  # in the model's order: the first such parameter is named
            grad, before = grads[i], self.assigned.get(i, (None, None))
            if grad is None or grad is self.shown[i] or (grad is before[0] and grad._version == before[1]):
                continue
            name = self.name_of[self.buckets.params[i]]
            raise RuntimeError(f"{name} got a grad from autograd: it was used outside the layer that "
                               "holds it (as in F.linear(x, layer.weight) or x * norm.weight), where the strategy "
                               "neither gathers it nor sees its grad; use it through its layer (a tied nn.Linear "
                               "head, as GPT-2's), or give the other use a parameter of its own")

    @torch.no_grad()
    def clear_some_grads(self, params, slots, set_to_none):
        """zero_grad of some parameters only (`slots`: the indices of the
        trainable ones): their places in model.grads and in the buckets are
        zeroed (what the others hold stays)."""
        names = {self.name_of[p] for p in params if p in self.name_of}
        for piece in self.all_pieces():
            grads = self.grads.get(piece.tensor)
            if grads is not None and piece.name in names:
                grads[piece.offset:piece.offset + piece.hi - piece.lo].zero_()
        buckets = self.buckets
        for i in slots:
            bucket = buckets.list[buckets.home[i]]
            if bucket.grads is not None:
                buckets.own_view(bucket.grads, i).zero_()
            bucket.parts.pop(i, None)
            if set_to_none:
                buckets.got_grad.marks[i] = 0
                buckets.expected.marks[i] = 0

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

    def refuse_foreign_grad(self, p):
        raise RuntimeError(f"{self.name_of[p]} has a p.grad that tiny_zero's layers did not make (the parameter was "
                           "used outside its layer, or p.grad was assigned): it would be ignored")

    def got_elsewhere(self, missing, stepping, everyone_missed, all_alike=False):
        """The parameters of `missing` (a forward on every rank used them; no
        grad came here) whose grad came on another rank: their averages hold
        it, and they step, as under torch DDP with find_unused_parameters.
        Where some rank missed none (the lowest count of the step's check),
        that is all of them; where every rank missed the same ones (a layer
        whose output no loss reads), none; else the ranks tell each other
        which they got: the one collective this costs, and only then.
        ddp, whose step's check is not waited for (everyone_missed None),
        tells by the averaged grads, which it holds whole: zero where no rank
        had a grad. (Where the ranks that had one all had exact zeros, they
        step it and this rank does not: the step's check then fails.)"""
        if everyone_missed is None:
            got = [p for p in missing if self.averaged_grad(p).any()]  # a host read, where a grad is missing only
        elif everyone_missed and all_alike:
            got = []
        elif everyone_missed:
            names = self.param_names()
            candidates = sorted(stepping + list(missing), key=names.get)  # the same on every rank (agreed)
            missing = set(missing)
            flags = torch.tensor([float(p not in missing) for p in candidates], device=self.device)
            comm.all_reduce(flags, group=self.replica_group)
            got = [p for p, n in zip(candidates, flags.tolist()) if p in missing and n > 0]
        else:
            got = list(missing)
        for p in got:
            self.buckets.got_grad.add(p)
            p.grad = self.shown_grad(p)
            self.showing.add(p)
        return got

    def averaged_grad(self, p):
        """p's averaged grad, where this rank holds it whole (one piece)."""
        piece = next(piece for piece in self.all_pieces() if piece.name == self.name_of[p])
        return self.grads[piece.tensor][piece.offset:piece.offset + piece.hi - piece.lo]

    def take_assigned_grad(self, name, p):
        """p.grad was replaced by another tensor: copy it in where the rank holds
        the grad whole (ddp), as torch would step with it; else refuse."""
        mine = self.shown_grad(p)
        if isinstance(mine, ShardedGrad):
            raise RuntimeError(f"p.grad of {name} was replaced, but {type(self).__name__} keeps averaged grads "
                               "sharded: change grads through model.clip_grad_norm_ and the optimizer only")
        mine.copy_(p.grad)
        p.grad = mine

    # ------------------------------------------------------------ clipping and fp16

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """Clip the grads to a global 2-norm of at most max_norm, as
        torch.nn.utils.clip_grad_norm_ on the unsharded model; returns the norm
        before clipping (a tensor; of the unscaled grads under fp16). The
        coefficient is applied inside the optimizer's kernel, with the loss
        scale, in the pass that reads the grads. It stays on the device, as
        torch's: the host never waits for the norm."""
        comm.where = "clip_grad_norm_"
        # every rank clips, by the same max_norm (a rank alone would send the norm's all-reduce alone, or
        # under ddp, which sends none, step its replica apart); checked before the rank's next collective
        comm.agree("clip_grad_norm_", wait=False, max_norm=comm.value_hash(float(max_norm)))
        self.forget_cleared_grads()
        self.apply_clip()  # a second clip sees the grads of the first, as torch's
        total_norm = self.grad_square_sum().sqrt()
        if self.loss_scaler is not None:
            total_norm = total_norm / self.scale_tensor()
        self.clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        return total_norm

    @torch.no_grad()
    def apply_clip(self):
        """Multiply the clip coefficient into model.grads, and forget it. The
        optimizer's kernel applies it as it reads the grads, and it stays
        pending after the step (a second step uses the clipped grads, as in
        torch); whatever else reads or adds to the grads after a clip (a
        second clip, a backward before zero_grad) gets them as torch's
        clip_grad_norm_ leaves them: clipped, at the cost of this one pass."""
        if self.clip_coef is not None:
            for g in self.grads.values():
                g.mul_(self.clip_coef)
            self.clip_coef = None

    def grad_square_sum(self):
        """The sum of the squares of the model's averaged grads, every element
        counted once (a scalar fp32 tensor, the same on every rank)."""
        square_sum = self.local_square_sum()
        if not self.grads_replicated:
            comm.all_reduce(square_sum)  # each rank holds a disjoint part
        return square_sum

    def local_square_sum(self):
        """This rank's part of grad_square_sum(): the squares of the grads it holds."""
        square_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in self.grads.values():
            square_sum += g.float().square().sum()
        return square_sum

    @property
    def loss_scale(self):
        """fp16's loss scale now, a number (a host read: for the user, never the step)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def scale_tensor(self):
        """fp16: the loss scale, a 0-d fp32 tensor on the device (LossScaler)."""
        return self.loss_scaler.on(self.device)

    def grad_scale(self):
        """What the optimizer multiplies the grads by: unscale and clip (a
        number, or a 0-d tensor on the grads' device under fp16 or after a clip)."""
        if self.loss_scaler is not None:
            scale = self.scale_tensor().reciprocal()
            return scale if self.clip_coef is None else self.clip_coef * scale
        return 1.0 if self.clip_coef is None else self.clip_coef

    def where_the_step_runs(self, *values):
        """The step's scale and skip, on the device of the shards it steps:
        where they are made (offload moves them to the host)."""
        return values

    @torch.no_grad()
    def found_overflow(self):
        """fp16: did any rank get an inf/nan grad? A 0-d fp32 tensor on the
        device, 1.0 or 0.0, after one all-reduce, so that every rank skips
        alike; the host never reads it (the kernel does: found_inf). None
        without fp16."""
        if self.loss_scaler is None:
            return None
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in self.grads.values():
            bad += (~torch.isfinite(g)).sum()
        comm.all_reduce(bad)
        return (bad > 0).float()


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the grad by the model's current
    fp16 loss scale, and tells the model that the scale entered this backward."""

    @staticmethod
    def forward(ctx, tensor, model):
        ctx.model = model
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.model.scale_entered = True
        return ScaleGrad.times(grad, ctx.model.scale_tensor()), None

    @staticmethod
    def times(grad, scale):
        """grad * scale (a 0-d fp32 tensor), multiplied in fp32. On CUDA, an
        fp16 tensor times a 0-d fp32 one casts the scale to fp16 first, where
        2**16 (the default scale) is inf; torch's unscale kernel multiplies
        in fp32 (its found_inf, a scratch here, is not read)."""
        if grad.dtype != torch.float16:
            return grad * scale
        out = grad.clone(memory_format=torch.contiguous_format)
        torch._amp_foreach_non_finite_check_and_unscale_([out], torch.zeros_like(scale), scale)
        return out


class StrategyAdamW(OptimizerStateDicts, torch.optim.Optimizer):
    """AdamW over what the wrapper says this rank holds: model.shards, with
    model.grads. A drop-in for torch.optim.AdamW on the wrapped model:

        opt = Zero2AdamW(model, lr=1e-3, weight_decay=0.1)
        opt = Zero2AdamW(model, [{"params": decay, "weight_decay": 0.1},
                                 {"params": ["ln.weight", ...], "weight_decay": 0.0}], lr=1e-3)

    Params are the module's parameters (before or after wrapping: the same
    objects) or their names. opt.param_groups drive the next step (lr
    schedulers work). Each parameter keeps its own step count, as torch's
    does: one that has no grad is not stepped. A shard's moments are flat, like
    the shard; the update runs once per stretch of a shard whose parameters
    share a group and a step count (usually one launch per shard)."""

    wrapper = None  # the wrapper class this optimizer belongs to, set by each strategy
    kernel = "auto"  # adamw_update_'s: the Triton kernel on CUDA, plain torch on the CPU

    def __init__(self, model, params=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        if not isinstance(model, self.wrapper):
            raise TypeError(f"{type(self).__name__} steps a {self.wrapper.__name__}-wrapped model, "
                            f"got {type(model).__name__}: use the optimizer of the model's strategy "
                            "(tiny_zero.STRATEGIES[name])")
        self.model = model
        self.skipped_steps = 0
        check_hparams(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(self._groups(params), defaults)
        # A parameter's index: its place in model.named_params; the step's bookkeeping is by index
        # (a dict keyed by Parameter objects hashes each one in Python, thousands of times a step).
        params = [p for _, p in model.named_params]
        self.index_of = {id(p): i for i, p in enumerate(params)}
        # Step counts. fp32, bf16: Python ints, as every step the host takes happens. fp16: a skip is
        # decided on the device, so the counts are a tensor there (where the shards are), advanced by
        # (1 - found_inf); the kernel reads its run's. `stamps`: a hash of the steps each parameter was
        # stepped in (equal stamps, equal counts), which groups the runs without reading the counts.
        self.counts = [0] * len(params)
        self.stamps = [0] * len(params)
        device = model.shards[0].device if model.shards else model.device
        self.device_counts = torch.zeros(len(params), device=device) if model.loss_scaler is not None else None
        self.masks = {}  # fp16: the stepping parameters' indices -> a 0/1 tensor over the counts
        position = {id(s): i for i, s in enumerate(model.shards)}
        pieces = sorted((p for p in model.all_pieces() if id(p.tensor) in position),
                        key=lambda p: (position[id(p.tensor)], p.offset))  # in layout order
        by_name = dict(model.named_params)
        # (parameter index, shard index, lo, hi) of each piece this rank steps, in layout order
        self.piece_rows = [(self.index_of[id(by_name[p.name])], position[id(p.tensor)], p.offset,
                            p.offset + p.hi - p.lo) for p in pieces]
        self.cached_runs = None  # (the key runs() was computed for, its runs)
        self.group_key = None  # the param groups that group_index was computed for
        self.group_index = [None] * len(params)  # each parameter's group (its index), None if none

    @property
    def skipped_steps(self):
        """Steps skipped for an fp16 overflow: under fp16 counted on the device,
        and read (a wait for the device) only here; otherwise a number."""
        return self.skips if isinstance(self.skips, int) else int(self.skips.item())

    @skipped_steps.setter
    def skipped_steps(self, n):
        fp16 = self.model.loss_scaler is not None
        self.skips = torch.tensor(float(n), device=self.model.device) if fp16 else int(n)

    def _groups(self, params):
        """torch-style groups, with names turned into the module's parameters."""
        by_name = dict(self.model.named_params)
        if params is None:
            params = [p for _, p in self.model.named_params]
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        out = []
        for group in groups:
            group = dict(group)
            items = group["params"]
            items = [items] if isinstance(items, (str, torch.Tensor)) else list(items)
            for item in items:
                if isinstance(item, str) and item not in by_name:
                    raise ValueError(f"{type(self).__name__}: no parameter named {item!r} in the model "
                                     f"(names are the module's: {', '.join(list(by_name)[:4])}, ...)")
            group["params"] = [by_name[p] if isinstance(p, str) else p for p in items]
            out.append(group)
        return out

    def add_param_group(self, param_group):
        known = {id(p) for _, p in self.model.named_params}
        params = param_group["params"]
        params = [params] if isinstance(params, (str, torch.Tensor)) else list(params)
        by_name = dict(self.model.named_params)
        params = [by_name.get(p, p) if isinstance(p, str) else p for p in params]
        for p in params:
            if isinstance(p, str) or id(p) not in known:
                raise ValueError(f"{type(self).__name__} steps the wrapped model's parameters only, got {p!r}")
        check_group({**self.defaults, **param_group})
        super().add_param_group({**param_group, "params": params})

    @property
    def loss_scale(self):
        return self.model.loss_scale

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        model = self.model
        comm.where = "the optimizer step"
        for group in self.param_groups:
            check_options(group)
        model.settle()
        written = model.param_writes()
        stepping = model.stepping(written)
        model.adopt_param_writes(written)  # after the agreement on how many were written
        found_inf = model.found_overflow()  # fp16: on the device; every rank skips alike, the host never knows
        # unscaled by the scale the grads were made with
        self._update(stepping, *model.where_the_step_runs(model.grad_scale(), found_inf))
        if found_inf is not None:
            model.loss_scaler.update(found_inf)
            self.skips.add_(found_inf)
        model.sync_params()
        model.steps += 1
        model.backwards = 0
        return loss

    def _update(self, stepping, grad_scale, found_inf):
        index_of, group_index = self.index_of, self.update_group_index()
        stepped = [i for i in (index_of[id(p)] for p in stepping) if group_index[i] is not None]
        runs = self.runs(stepped)
        self.advance(stepped, found_inf)
        for shard_index, lo, hi, group, first in runs:
            shard = self.model.shards[shard_index]
            beta1, beta2 = group["betas"]
            exp_avg, exp_avg_sq = self.moments(shard)
            out = self.model.working.get(shard)
            step = self.counts[first] if self.device_counts is None else self.device_counts[first]
            adamw_update_(shard[lo:hi], self.model.grads[shard][lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi],
                          lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                          weight_decay=group["weight_decay"], step=step, grad_scale=grad_scale,
                          param_out=None if out is None else out[lo:hi], kernel=self.kernel, found_inf=found_inf)

    def advance(self, stepped, found_inf):
        """The step counts of the parameters `stepped` (indices) go up by one,
        before their update reads them; under fp16 on the device, where the
        step was not skipped, in one op."""
        stamps, step = self.stamps, self.model.steps
        for i in stepped:
            stamps[i] = (stamps[i] * 31 + step + 1) % (1 << 61)
        if self.device_counts is None:
            counts = self.counts
            for i in stepped:
                counts[i] += 1
            return
        key = tuple(stepped)
        if key not in self.masks:
            mask = torch.zeros(len(self.counts))
            mask[list(stepped)] = 1.0
            self.masks[key] = mask.to(self.device_counts.device)  # once per set of stepping parameters
        self.device_counts.addcmul_(self.masks[key], 1 - found_inf.to(self.device_counts.device))

    def update_group_index(self):
        """group_index, recomputed only when the param groups changed."""
        key = tuple((id(g["params"]), len(g["params"])) for g in self.param_groups)
        if key != self.group_key:
            self.group_index = [None] * len(self.counts)
            for g, group in enumerate(self.param_groups):
                for p in group["params"]:
                    self.group_index[self.index_of[id(p)]] = g
            self.group_key = key
        return self.group_index

    def moments(self, shard):
        state = self.state[shard]
        if not state:
            state["exp_avg"] = torch.zeros_like(shard)
            state["exp_avg_sq"] = torch.zeros_like(shard)
        return state["exp_avg"], state["exp_avg_sq"]

    def count(self, i):
        """Parameter i's step count, a number (under fp16 a host read: for a save)."""
        return self.counts[i] if self.device_counts is None else float(self.device_counts[i])

    def set_count(self, i, step):
        if self.device_counts is None:
            self.counts[i] = int(step)
        else:
            self.device_counts[i] = float(step)
        self.stamps[i] = (1 << 60) + int(step)  # equal counts, equal stamps: no history to tell them apart
        self.cached_runs = None

    def runs(self, stepped):
        """(shard index, lo, hi, group, first parameter's index): the stretches
        of shards to update, one launch each: adjacent pieces of parameters
        that step now (indices), in the same group, with the same step count.
        A piece that does not step ends a stretch. Made again only when the
        parameters that step, or the groups, change: where the same ones step
        as last time, their counts all moved together."""
        key = (tuple(stepped), self.group_key)
        if self.cached_runs is not None and self.cached_runs[0] == key:
            return self.cached_runs[1]
        steps = [False] * len(self.counts)
        for i in stepped:
            steps[i] = True
        stamps, group_index = self.counts if self.device_counts is None else self.stamps, self.group_index
        keys = [(shard, group_index[i], stamps[i]) if steps[i] else None for i, shard, _, _ in self.piece_rows]
        runs = []
        for run_key, same in groupby(zip(keys, self.piece_rows), key=lambda item: item[0]):
            if run_key is None:
                continue
            rows = [row for _, row in same]
            (first, shard, lo, _), hi = rows[0], rows[-1][3]
            runs.append((shard, lo, hi, self.param_groups[run_key[1]], first))
        self.cached_runs = (key, runs)
        return runs

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none, params=[p for group in self.param_groups for p in group["params"]])
