"""Mixed precision: parameter dtypes, and the dynamic loss scaler of fp16.

Under mixed precision the model's parameters, activations and gradients are
bf16 or fp16; the optimizer keeps fp32 master weights and AdamW state for the
tensors it steps (tiny_zero.optim.AdamW does this for any low-precision
parameter). fp16's small range needs loss scaling: the loss is multiplied by
a large scale before backward so small grads do not flush to zero, and the
optimizer divides it out again (inside the AdamW kernel, with clipping).
Floating-point inputs are cast to the parameters' dtype as they enter the
model (cast_floating_inputs).

The loss scale's way into backward: scale_output, a forward hook of the
wrapped module, and ScaleGrad (guards.py's check_scale_entered, as a
backward begins, refuses a backward it did not enter). Its way out in the
step, and fp16's overflow check (its all-reduce), are in optimizer.py's
Clipping, with the clip.
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


def check_param_dtypes(module, mixed_precision):
    """Without mixed precision a strategy trains in float32 (its flat buffers,
    masters and AdamW are float32). A float64 module (module.double() before
    wrapping) is refused rather than rounded to float32 without a word, after
    which a float64 batch would fail inside torch."""
    if mixed_precision is not None:
        return  # asked for: the module is cast to it
    for name, p in module.named_parameters():
        if p.dtype == torch.float64:
            raise TypeError(f"{name} is torch.float64: tiny_zero's strategies train in float32 (or bf16 and fp16 "
                            "with mixed_precision=), and would round it. Call module.float() before wrapping "
                            "(and give float32 inputs), or train float64 with torch's DistributedDataParallel")


def param_dtype(mixed_precision):
    if mixed_precision not in DTYPES:
        raise ValueError(f"mixed_precision must be one of {list(DTYPES)}, got {mixed_precision!r}")
    return DTYPES[mixed_precision]


class LossScaler:
    """Dynamic loss scaling with DeepSpeed's defaults and update rule.

    On an overflow (inf/nan in any rank's grads) the step is skipped. The
    first `hysteresis - 1` overflows in a row leave the scale alone; after
    that each one halves it (never below min_scale; an overflow at min_scale
    is an error). A run of steps without overflow doubles the scale, and
    restores the hysteresis, at its (window + 1)-th step and every `window`
    steps after, as DeepSpeed's DynamicLossScaler counts.

    The scale, the hysteresis left and the steps since the last overflow are
    0-d tensors on the grads' device, updated there, as torch's GradScaler
    keeps its scale: the host never waits to learn whether a step overflowed.
    Reading `scale` (a number) or state_dict() reads them."""

    def __init__(self, init_scale=2.0**16, window=1000, hysteresis=2, min_scale=1.0):
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.iteration = 0  # updates so far: the host knows every one happened
        self.set_state(float(init_scale), hysteresis, since_overflow=1, device="cpu")

    def set_state(self, scale, hysteresis_left, since_overflow, device):
        self.tensor = torch.tensor(float(scale), device=device)  # the scale itself (ScaleGrad multiplies by it)
        self.hysteresis_left = torch.tensor(float(hysteresis_left), device=device)
        # iteration - the iteration of the last overflow (-1 before any): the window counts from it
        self.since_overflow = torch.tensor(float(since_overflow), device=device)

    def on(self, device):
        """The scale, a 0-d fp32 tensor on `device`, where the state moves on first use."""
        if self.tensor.device != device:
            self.set_state(self.scale, float(self.hysteresis_left), float(self.since_overflow), device)
        return self.tensor

    @property
    def scale(self):
        return self.tensor.item()  # a host read: for whoever asks, never the step

    @torch.no_grad()
    def update(self, found_inf):
        """After a step: found_inf, a 0-d tensor (nonzero: some grad was not
        finite) or a bool. Tensor ops only; nothing is read on the host."""
        overflow = torch.as_tensor(found_inf, device=self.tensor.device) != 0
        halve = overflow & (self.hysteresis_left <= 1)
        # DeepSpeed raises here; the device cannot, so it asserts (at once on the CPU; on CUDA the
        # assert fails the process at the device's next sync)
        torch._assert_async(~(halve & (self.tensor <= self.min_scale)),
                            f"fp16 gradients overflow even at the minimum loss scale {self.min_scale}: "
                            "the loss or the model diverged (try a lower learning rate, or bf16)")
        stable = self.since_overflow - 1  # DeepSpeed's stable interval: clean steps since the last overflow, less one
        grow = ~overflow & (stable > 0) & (stable % self.window == 0)
        self.tensor.copy_(torch.where(halve, torch.clamp(self.tensor / 2, min=self.min_scale),
                                      torch.where(grow, self.tensor * 2, self.tensor)))
        self.hysteresis_left.copy_(torch.where(grow, float(self.hysteresis),
                                               torch.where(overflow & ~halve, self.hysteresis_left - 1,
                                                           self.hysteresis_left)))
        self.since_overflow.copy_(torch.where(overflow, 1.0, self.since_overflow + 1))
        self.iteration += 1

    def state_dict(self):
        """Host numbers, as DeepSpeed's scaler keeps them (a save may read the device)."""
        return dict(scale=self.scale, window=self.window, hysteresis=self.hysteresis, min_scale=self.min_scale,
                    hysteresis_left=int(self.hysteresis_left), iteration=self.iteration,
                    last_overflow=self.iteration - int(self.since_overflow))

    def load_state_dict(self, state):
        self.window, self.hysteresis, self.min_scale = state["window"], state["hysteresis"], state["min_scale"]
        self.iteration = state["iteration"]
        self.set_state(state["scale"], state["hysteresis_left"], self.iteration - state["last_overflow"],
                       self.tensor.device)


def scale_output(model, module, args, out):
    """fp16, a forward hook of the wrapped module (with `model` bound: its
    wrapper): grads are scaled from where they enter the model, so
    loss.backward() and model.backward(loss) are the same, and model(x) and
    model.module(x) too."""
    if not torch.is_grad_enabled():
        return out
    return tree_map_only(torch.Tensor, lambda t: ScaleGrad.apply(t, model) if t.requires_grad else t, out)


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the grad by the model's current
    fp16 loss scale, and tells the model that the scale entered this backward."""

    @staticmethod
    def forward(ctx, tensor, model):
        ctx.model = model
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        model = ctx.model
        model.scale_entered = True
        return ScaleGrad.times(grad, model.loss_scaler.on(model.device)), None

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
