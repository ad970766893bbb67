"""Models built on the meta device: no rank ever allocates the whole model.

A meta parameter gets its value here, one tensor at a time, as a strategy
shards the model. Two cases:

- The model has `init_parameter(name, tensor)` (example/model.py): it fills
  `tensor` with the value parameter `name` has when the model is built
  normally.
- It has none (a Hugging Face model): the values will come from pretrained
  weights, tiny_zero.checkpoint.load_pretrained(model, path). Until then the
  parameters are NaN and the model's forward raises, so nothing trains on
  values that were never set.

Hugging Face models compute some buffers when they are built (the rotary
frequencies of Llama and Qwen) and keep them out of their checkpoints: build
those under meta_parameters(), which puts only the parameters on meta.
"""
from contextlib import contextmanager

import torch
import torch.nn as nn

from . import comm

NOT_LOADED = "not_loaded"  # module.__dict__ key: the hook that stops forward until weights are loaded
SLICE = "zero_slice"  # a parameter built under tiny_zero.zero.Init: this rank's 1/N of its values (zero.py)


def full_value(module, name, param, device):
    """The full value of one parameter: its own data, or, for a meta one, the
    model's init, or NaN until load_pretrained fills it."""
    if not param.is_meta:
        return param.data.to(device)
    if hasattr(param, SLICE):
        return gathered_value(param, device)
    value = torch.empty(param.shape, dtype=param.dtype, device=device)
    if hasattr(module, "init_parameter"):
        module.init_parameter(name, value)
    else:
        value.fill_(float("nan"))
        wait_for_weights(module)
    return value


def gathered_value(param, device):
    """The whole value of a parameter that each rank holds 1/N of (built under
    tiny_zero.zero.Init): one all-gather of the slices, on every rank alike."""
    piece = getattr(param, SLICE).to(device)
    full = torch.empty(piece.numel() * comm.get_world_size(), dtype=piece.dtype, device=device)
    comm.all_gather(full, piece)
    return full[:param.numel()].view(param.shape)


def set_data(param, value):
    """Point `param` at `value`, keeping the Parameter object (so tied layers
    stay tied). A meta parameter cannot take real data through .data, so its
    contents are swapped instead, for a tensor on value's memory with a
    version counter of its own (value.data), as `.data =` keeps the
    parameter's: a write into the buffer that value is a view of is not a
    write into the parameter (StateDicts.adopt_param_writes tells them apart)."""
    if param.is_meta:
        torch.utils.swap_tensors(param, torch.nn.Parameter(value.data, requires_grad=param.requires_grad))
    else:
        param.data = value


def wait_for_weights(module):
    """Until weights_loaded(module), calling module raises."""
    if NOT_LOADED not in module.__dict__:
        module.__dict__[NOT_LOADED] = module.register_forward_pre_hook(_not_loaded)


def weights_loaded(module):
    hook = module.__dict__.pop(NOT_LOADED, None)
    if hook is not None:
        hook.remove()


def _not_loaded(module, args):
    raise RuntimeError(f"{type(module).__name__} was built on the meta device and has no "
                       "init_parameter(name, tensor) to give its parameters values: load them first, with "
                       "tiny_zero.checkpoint.load_pretrained(model, path) (or tiny_zero.checkpoint.load)")


@contextmanager
def meta_parameters():
    """Build a model with its parameters on the meta device and its buffers
    real: for a model that computes buffers when it is built and whose
    parameters load_pretrained will fill.

        with meta_parameters():
            module = LlamaForCausalLM(config)

    Each parameter is moved to meta as it is registered; a layer's own init
    then runs on meta and costs nothing."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
