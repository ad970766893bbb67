"""Mixed precision: parameter dtypes, and the dynamic loss scaler of fp16.

Under mixed precision the model's parameters, activations and gradients are
bf16 or fp16; the optimizer keeps fp32 master weights and moments for the
tensors it steps (tiny_zero.optim.AdamW does this for any low-precision
parameter). fp16's small range needs loss scaling: the loss is multiplied by
a large scale before backward so small grads do not flush to zero, and the
optimizer divides it out again (inside the AdamW kernel, with clipping).
Floating-point inputs are cast to the parameters' dtype as they enter the
model (cast_floating_inputs).
"""
import torch
from torch.utils._pytree import tree_map_only

DTYPES = {None: torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def take_written_(master, values):
    """A write into a low-precision parameter in place, into its fp32 master:
    the elements of `values` (the parameter's, in its dtype) that differ from
    the master's rounding to that dtype are copied in; the others keep the
    master's fp32 precision."""
    values = values.to(master.device)  # offload: the masters are in host memory
    master.copy_(torch.where(values != master.to(values.dtype), values.to(master.dtype), master))


def cast_floating_inputs(dtype):
    """A forward pre-hook for the wrapped module under bf16 and fp16: its
    floating-point tensor inputs are cast to `dtype`, the parameters', as
    FSDP2 casts them (MixedPrecisionPolicy's cast_forward_inputs). A float32
    batch would otherwise meet low-precision weights in the first Linear
    ("mat1 and mat2 must have the same dtype"); integer inputs (token ids,
    labels) stay as they are."""
    def cast(module, args, kwargs):
        return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))
    return cast


def param_dtype(mixed_precision):
    if mixed_precision not in DTYPES:
        raise ValueError(f"mixed_precision must be one of {list(DTYPES)}, got {mixed_precision!r}")
    return DTYPES[mixed_precision]


class LossScaler:
    """Dynamic loss scaling with DeepSpeed's defaults and update rule.

    On an overflow (inf/nan in any rank's grads) the step is skipped. The
    first `hysteresis - 1` overflows in a row leave the scale alone; after
    that each one halves it (never below min_scale; an overflow at min_scale
    raises). After `window` steps without overflow the scale doubles and the
    hysteresis is restored."""

    def __init__(self, init_scale=2.0**16, window=1000, hysteresis=2, min_scale=1.0):
        self.scale = float(init_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.hysteresis_left = hysteresis
        self.iteration = 0
        self.last_overflow = -1

    def update(self, overflow):
        if overflow:
            if self.hysteresis_left <= 1:
                if self.scale <= self.min_scale:
                    raise FloatingPointError(
                        f"fp16 gradients overflow even at the minimum loss scale {self.min_scale}: "
                        "the loss or the model diverged (try a lower learning rate, or bf16)")
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        elif (self.iteration - self.last_overflow) % self.window == 0:
            self.hysteresis_left = self.hysteresis
            self.scale *= 2
        self.iteration += 1

    def state_dict(self):
        return dict(vars(self))

    def load_state_dict(self, state):
        vars(self).update(state)
