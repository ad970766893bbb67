"""DeepSpeed's deepspeed.zero.Init and GatheredParameters: a model built with each rank holding 1/N of it.

    with tiny_zero.zero.Init():
        model = build()    # each module's parameters are cut in N as its __init__ returns
    engine, *_ = tiny_zero.initialize(model=model, config="ds_config.json")  # any stage

As DeepSpeed's Init: each module's own __init__ runs as it would (its
parameters whole for that moment, one module at a time, initialised by the
module's own code and random numbers), then each of its parameters takes
rank 0's values and keeps only this rank's 1/N slice (padded), and becomes a
meta tensor of its full shape. So a rank never holds more than its slices
and one module's parameters (but see post_init below). Wrapping gathers each
parameter whole, one at a time, and lays it out as the strategy holds it
(tiny_zero/materialize.py: full_value). The model's forward cannot run before it is wrapped.

A module with a model-wide init of its own, duck-typed as a `post_init`
method (transformers' PreTrainedModel), rewrites its descendants' parameters
at the end of its __init__. DeepSpeed leaves that to transformers (which
gathers around it when it knows ZeRO-3 is on); tiny_zero does not import
transformers, so instead the cutting of every module built inside such a
module waits until its __init__ returns, and then all are cut in the order
they were built. Its post_init thus sees whole parameters and the model
equals the one built whole with the same seed (cutting draws no random
numbers). The price: while that outermost __init__ runs, a rank holds the
whole model, as without Init; plain torch modules still hold one module at
a time. Any other parent that writes into a child's parameters after
building it must write inside GatheredParameters(params, modifier_rank=0),
as under DeepSpeed: the parameters are whole inside, and rank 0's values are
cut again on the way out.
"""
import inspect

import torch
import torch.nn as nn

from . import comm
from .distributed import init_distributed
from .materialize import SLICE, gathered_value


class Init:
    """Build modules cut in N: the classes' __init__ are wrapped while the context is open."""

    def __init__(self, module=None, enabled=True, **deepspeed_options):
        """module: one built already, cut now. deepspeed_options (config_dict_or_path, dtype,
        remote_device, pin_memory, ...) have no effect: the wrapper casts and places the parameters."""
        self.enabled, self.originals, self.depth = enabled, {}, {}
        self.owner, self.waiting = None, []  # the module with a model-wide init being built; those built inside it
        if module is not None and enabled:
            init_distributed()
            for m in module.modules():
                cut_parameters(m)

    def __enter__(self):
        if self.enabled:
            init_distributed()  # every rank cuts alike: the collectives need the group
            for cls in subclasses(nn.Module):
                self.wrap(cls)
            self.had_hook = "__init_subclass__" in nn.Module.__dict__
            init = self

            def subclassed(cls, **kwargs):  # a module class defined inside the context
                super(nn.Module, cls).__init_subclass__(**kwargs)
                init.wrap(cls)
            nn.Module.__init_subclass__ = classmethod(subclassed)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            for cls, original in self.originals.items():
                cls.__init__ = original
            self.originals.clear()
            if not self.had_hook:
                del nn.Module.__init_subclass__
        return False

    def wrap(self, cls):
        original = cls.__dict__.get("__init__")
        if not inspect.isfunction(original) or cls in self.originals:
            return
        init = self

        def __init__(module, *args, **kwargs):
            init.build(original, module, args, kwargs)
        __init__.__wrapped__ = original
        self.originals[cls] = original
        cls.__init__ = __init__

    def build(self, original, module, args, kwargs):
        """Run one class's __init__; once the outermost (the module's own class) returns, cut what it holds."""
        key = id(module)
        self.depth[key] = self.depth.get(key, 0) + 1
        if self.owner is None and callable(getattr(type(module), "post_init", None)):
            self.owner = key  # its post_init will rewrite its descendants: they must stay whole till then
        try:
            original(module, *args, **kwargs)
        except BaseException:
            if self.depth[key] == 1 and self.owner == key:
                self.owner, self.waiting = None, []  # it failed: nothing of it to cut
            raise
        finally:
            self.depth[key] -= 1
            outermost = self.depth[key] == 0
            if outermost:
                del self.depth[key]
        if outermost:
            self.finish(module)

    def finish(self, module):
        """A module built: cut it now, or, inside a module with a model-wide init, once that one is built."""
        if self.owner is None:
            cut_parameters(module)
            return
        self.waiting.append(module)
        if self.owner == id(module):
            waiting, self.owner, self.waiting = self.waiting, None, []
            for m in waiting:
                cut_parameters(m)


def subclasses(cls):
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo += c.__subclasses__()
    return out


@torch.no_grad()
def cut_parameters(module):
    """Each whole parameter of `module` (its own, not its children's): rank 0's values, cut in N."""
    for param in module.parameters(recurse=False):
        if not param.is_meta:
            comm.broadcast(param.data, src=0)  # every rank starts from rank 0's values, as a wrapper does
            cut(param, param.data)


def cut(param, value):
    """param becomes a meta tensor of its full shape, with this rank's 1/N of `value` beside it."""
    n, rank = comm.get_world_size(), comm.get_rank()
    size = -(-value.numel() // n)
    flat = torch.zeros(size * n, dtype=value.dtype, device=value.device)
    flat[:value.numel()] = value.reshape(-1)
    piece = flat[rank * size:(rank + 1) * size].clone()
    swap(param, torch.empty(value.shape, dtype=value.dtype, device="meta"))
    setattr(param, SLICE, piece)


def swap(param, data):
    """Give `param` new contents, keeping the object (tied layers stay tied) and its attributes."""
    attributes = dict(param.__dict__)
    torch.utils.swap_tensors(param, nn.Parameter(data, requires_grad=param.requires_grad))
    param.__dict__.update(attributes)


class GatheredParameters:
    """DeepSpeed's: inside, the parameters built under Init are whole on every rank; on the way out,
    modifier_rank's values (if given) are cut again on every rank, else the changes are dropped.
    Parameters not built under Init pass through (as DeepSpeed's do when not partitioned); those of a
    model already wrapped are read with model.full_state_dict()."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params if enabled else ():
            if not hasattr(p, SLICE) and p.untyped_storage().nbytes() < p.numel() * p.element_size():
                raise ValueError("zero.GatheredParameters: a parameter of shape {} is held in slices by a tiny_zero "
                                 "wrapper, which would show it released here: read the whole values with "
                                 "model.full_state_dict() (on every rank)".format(tuple(p.shape)))
        self.params = list({id(p): p for p in params if hasattr(p, SLICE)}.values()) if enabled else []
        self.modifier_rank = modifier_rank

    def __enter__(self):
        for p in self.params:
            swap(p, gathered_value(p, getattr(p, SLICE).device))
        return self

    @torch.no_grad()
    def __exit__(self, *exc):
        for p in self.params:
            if self.modifier_rank is None:
                swap(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))  # the slice beside it stays
            else:
                comm.broadcast(p.data, src=self.modifier_rank)
                cut(p, p.data)
        return False
