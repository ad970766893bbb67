"""Parameters built on the meta device get their values here, one tensor at a
time, from the model's own deterministic init: `module.init_parameter(name,
tensor)` fills `tensor` with the value that parameter `name` has when the
model is built normally. So no rank ever allocates the whole model."""
import torch


def full_value(module, name, param, device):
    """The full value of one parameter: its own data, or the model's init for a meta one."""
    if not param.is_meta:
        return param.data.to(device)
    if not hasattr(module, "init_parameter"):
        raise TypeError(f"{type(module).__name__} was built on the meta device but has no "
                        "init_parameter(name, tensor) method to give its parameters values")
    value = torch.empty(param.shape, dtype=param.dtype, device=device)
    module.init_parameter(name, value)
    return value


def set_data(param, value):
    """Point `param` at `value`, keeping the Parameter object (so tied layers
    stay tied). A meta parameter cannot take real data through .data, so its
    contents are swapped instead."""
    if param.is_meta:
        torch.utils.swap_tensors(param, torch.nn.Parameter(value, requires_grad=param.requires_grad))
    else:
        param.data = value
