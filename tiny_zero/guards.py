"""Misuse turned into clear errors, the same on every rank (a first reader
may skip this file): a model wrapped twice, models that differ across
ranks, an fp16 backward that the loss scale does not enter, p.grad of a
strategy that keeps averaged grads sharded used as if it were the whole
grad, a parameter read where zero3 and fsdp hold it released
(ReleasedReads), a layer converted after wrapping (ConversionGuard), a
second backward through one forward, requires_grad changed after wrapping,
and model.<name> for an attribute of the wrapped module (forwarded_getattr,
Wrapper's __getattr__)."""
import functools
import zlib
from array import array
from contextlib import nullcontext
from operator import attrgetter

import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_leaves  # a foreach op takes lists of grads

from . import comm

REQUIRES_GRAD = attrgetter("requires_grad")  # read by map(), over many parameters in C


def check_not_wrapped(module):
    """Wrapped once: by one tiny_zero strategy, and not inside torch's DDP or
    FSDP, whose own collectives would run beside the strategy's and fail
    differently on each rank at the next step."""
    for path, layer in module.named_modules():
        if "wrapper" in layer.__dict__:
            raise RuntimeError(f"{type(module).__name__} is already wrapped by "
                               f"{type(layer.__dict__['wrapper']).__name__}: wrap the plain module once")
        where = f"{type(module).__name__}.{path}" if path else "the module"
        if isinstance(layer, DistributedDataParallel):
            raise RuntimeError(f"{where} is torch's DistributedDataParallel: wrap its .module (the "
                               "plain module) with tiny_zero instead, not both")
        if isinstance(layer, FSDPModule):
            raise RuntimeError(f"{where} is sharded by torch's fully_shard (FSDP2): wrap the plain module with "
                               "tiny_zero instead, not both")


def check_same_model_on_all_ranks(module):
    """One all_gather of the parameter list: names, shapes, dtypes,
    requires_grad and whether on meta must match, or every rank raises (rather
    than hang or train garbage: a strategy sends a parameter's values only
    where they exist, so a model on meta on some ranks only would leave those
    waiting for a broadcast the others never send)."""
    mine = [(name, tuple(p.shape), str(p.dtype), p.requires_grad, "meta" if p.is_meta else "allocated")
            for name, p in module.named_parameters()]
    everyone = comm.all_gather_object(mine)
    for rank, theirs in enumerate(everyone):
        if theirs != mine:
            first = next((f"{a} vs {b}" for a, b in zip(mine, theirs) if a != b),
                         f"{len(mine)} vs {len(theirs)} parameters")
            raise RuntimeError(f"the model differs across ranks (this rank vs rank {rank}): {first}")


def check_scale_entered(model):
    """fp16, as a backward pass begins: it starts from the model's output, where the scale enters."""
    if model.loss_scaler is not None and not model.scale_entered:
        raise RuntimeError("fp16: this backward does not start from the model's output, where the loss scale "
                           "enters (a loss from a submodule's output, model.module.transformer(x)?): its grads "
                           "would reach the optimizer unscaled, and it divides them by the scale. Compute the "
                           "loss from model(...) (or model.module(...))")


def parameter_hash(buckets, params):
    """An integer that names a set of the buckets' parameters, the same on
    every rank (whose buckets hold the same parameters in the same order)."""
    marks = bytearray(len(buckets.params))
    for i in map(buckets.index.__getitem__, map(id, params)):
        marks[i] = 1
    return zlib.crc32(marks)


def sequence_hash(numbers):
    """An integer that tells sequences of small integers apart (their order too)."""
    return zlib.crc32(array("q", numbers))


# What model.<name> finds on the wrapped module, as DeepSpeed's engine
# forwards it: only what reads no parameter outside a forward (generate's
# forwards run through the strategy's layers), since a rank may hold only
# its part of a parameter. Anything else the module has: model.module.<name>.
FORWARDED = ("generate", "config", "generation_config", "can_generate", "main_input_name",
             "gradient_checkpointing_enable", "gradient_checkpointing_disable", "enable_input_require_grads")


def forwarded_getattr(model, name):
    """Wrapper's __getattr__: model.<name> for what the wrapped module has."""
    try:
        return torch.nn.Module.__getattr__(model, name)  # parameters, buffers, submodules (model.module)
    except AttributeError:
        module = model.__dict__.get("_modules", {}).get("module")
        if module is None or not hasattr(module, name):
            raise
    if name == "generate" and not model.params_whole_between_steps and model.world_size > 1:
        # every forward sends collectives: a rank whose sequences have ended
        # runs forwards on until every rank's have (Hugging Face's synced_gpus)
        return functools.partial(module.generate, synced_gpus=True)
    if name in FORWARDED:
        return getattr(module, name)
    raise AttributeError(f"{type(model).__name__} has no attribute {name!r}; the wrapped module has: use "
                         f"model.module.{name}, on every rank alike (outside a forward, a parameter may hold "
                         "only this rank's part)")


class ShardedGrad(torch.Tensor):
    """What p.grad holds, once a parameter has a grad, under a strategy that
    keeps averaged grads sharded: a tensor of the parameter's shape with no
    data, that raises a clear error when anything uses it. So
    torch.nn.utils.clip_grad_norm_(model.parameters()), a torch optimizer or a
    grad-norm logger fail loudly instead of reading nothing; `p.grad is None`
    still tells whether a parameter has a grad, as in torch."""

    @staticmethod
    def __new__(cls, param, strategy):
        grad = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        grad.strategy = strategy
        return grad

    # what it may tell: its metadata, the parameter's (and `is None`, of p.grad)
    METADATA = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
                torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_sparse.__get__,
                torch.Tensor.layout.__get__, torch.Tensor.requires_grad.__get__}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__repr__:
            return f"ShardedGrad({args[0].strategy})"
        if func in cls.METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        strategy = next((a.strategy for a in tree_leaves(args) if isinstance(a, ShardedGrad)), "this strategy")
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            raise RuntimeError(
                f"torch.amp.GradScaler unscales p.grad, which {strategy} keeps sharded across ranks: drop the "
                f"GradScaler and wrap with mixed_precision='fp16', whose loss scaler does its work (scales the loss "
                f"of loss.backward(), unscales in the optimizer step, skips a step with inf/nan grads on every rank)")
        raise RuntimeError(
            f"{strategy} keeps each averaged grad sharded across ranks, not in p.grad: clip with "
            "model.clip_grad_norm_(max_norm) (it returns the global norm), step with the strategy's "
            "optimizer, and read a full grad nowhere (p.grad only tells that a parameter has one)")

    def __deepcopy__(self, memo):
        """copy.deepcopy of the model (an EMA, a reference model): the copy gets a placeholder of its own."""
        return ShardedGrad(self, self.strategy)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("a sharded grad has no data (see ShardedGrad)")


def released_reads(wrapper):
    """ReleasedReads over a zero3 or fsdp wrapper's first forward with grads
    and its first without, before the gather order is recorded (the others:
    nothing), so that a model only ever evaluated is not watched forever."""
    mode = torch.is_grad_enabled()
    if not wrapper.releases_params or not wrapper.order.recording or mode in wrapper.watched:
        return nullcontext()
    wrapper.watched.add(mode)
    return ReleasedReads(wrapper)


# what a parameter may be asked while released: methods, then properties (p.T, p.data: values, not here)
METADATA = {"size", "dim", "stride", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
            "data_ptr", "untyped_storage", "storage_offset", "is_contiguous", "get_device", "requires_grad_",
            "__hash__", "__len__", "new_zeros", "new_ones", "new_empty", "new_full", "__set__",
            "shape", "dtype", "device", "layout", "ndim", "itemsize", "nbytes", "names", "is_cuda", "is_meta",
            "is_sparse", "is_quantized", "is_nested", "requires_grad", "is_leaf", "grad", "grad_fn", "_version"}


class ReleasedReads(TorchFunctionMode):
    """While a forward runs before the gather order is recorded: a torch
    function given a parameter of the model whose unit is not gathered
    (released: zeros of its shape, or on zero3's owner its own values) raises
    before it computes, naming it. Whether a unit is gathered is the same on
    every rank, so every rank raises at the same read, with no collective of
    the pass left waiting. Only the first forwards are watched
    (released_reads): later steps run the same code, and a steady-state step
    pays nothing."""

    def __init__(self, wrapper):
        super().__init__()
        self.wrapper = wrapper

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if name == "__get__":  # a property: its own name
            name = getattr(func.__self__, "__name__", None)
        if name not in METADATA:
            for t in tree_flatten((args, kwargs or {}))[0]:
                self.check(t)
        return func(*args, **(kwargs or {}))

    def check(self, t):
        wrapper = self.wrapper
        found = wrapper.unit_of_param.get(id(t)) if isinstance(t, torch.nn.Parameter) else None
        if found is None or found[0] is not t or found[1] in wrapper.gathered:
            return
        raise RuntimeError(
            f"{wrapper.name_of[t]} was read while released: {type(wrapper).__name__} gathers a parameter only while "
            "a layer of its unit runs (and frozen ones outside every block through the pass), and this read is "
            "outside the module that holds it (as in F.linear(x, layer.weight) or x * norm.weight in another "
            "module); it would read zeros. Use it through its module (a tied nn.Linear head, as GPT-2's), or give "
            "the other use a parameter of its own")


class ConversionGuard:
    """Mixed into every strategy layer (step.StrategyLayer)."""

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


def check_backward_once(ctx, path):
    """A layer's backward: one per forward, from loss.backward()."""
    if not ctx.param_grads:
        raise RuntimeError(f"{path}: torch.autograd.grad (or backward(inputs=...)) through a strategy's "
                           "layers: each layer's backward hands its parameters' grads to the strategy, which "
                           "cannot leave them out as torch does; call loss.backward() (an input that requires "
                           "grad gets its x.grad) and keep the grads you need")
    if getattr(ctx, "backward_ran", False):
        raise RuntimeError(f"{path}: a second backward through the same forward (backward(retain_graph="
                           "True), then backward again): a strategy sends each layer's grads once per forward, "
                           "as torch DDP does; add the losses and call backward once, or run the forward again")
    ctx.backward_ran = True


def check_requires_grad(model):
    """At each step: requires_grad reads what it read when wrapping (what this rank holds; a stage: its own)."""
    if list(map(REQUIRES_GRAD, model.checked)) != model.requires:
        p = next(p for p, wanted in zip(model.checked, model.requires) if p.requires_grad != wanted)
        raise RuntimeError(f"{model.name_of[p]}.requires_grad changed after the model was wrapped: tiny_zero "
                           "reads it once, when wrapping, to decide what is sent and stepped; set it before "
                           "wrapping")
