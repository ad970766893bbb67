"""The AdamW update on flat tensors: the math in plain torch, one op per
formula line, and `adamw_update_`, which dispatches it.

`torch_adamw_update_` is the path on the CPU and the readable statement of
the math that the Triton kernel (kernel.py, GPU) fuses into one pass. Its op
sequence mirrors torch.optim.AdamW's single-tensor implementation, so on the
same device the results are bit-identical. Asked for by name, the update is
torch's own fused AdamW kernel (fused.py: the fastest on the CPU, where
ZeRO-Offload steps). The strategies call `adamw_update_` on their flat
shards; the drop-in `AdamW` (drop_in.py) calls it once per flat buffer.

Triton is imported lazily, only when the Triton path actually runs, so this
module works on machines where triton is missing or cannot compile.
"""

import functools
import os

import torch

KERNELS = ("auto", "triton", "torch", "fused")


@functools.lru_cache(maxsize=None)
def _triton_importable():
    try:
        import triton  # noqa: F401
        return True
    except Exception:
        return False


def _triton_interpret():
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


def _check_kernel(kernel):
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")


def adamw_update_(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                  grad_scale=1.0, param_out=None, kernel="auto", found_inf=None):
    """One AdamW step on flat 1-D tensors of equal numel, in place.

    param: fp32 (master weights), contiguous. grad: any float dtype; the step uses
    grad.float() * grad_scale (grad_scale: 1/loss_scale times a clipping coefficient; a number, or
    a 0-d fp32 tensor on param's device that the kernel reads itself, so the host never waits for it).
    exp_avg, exp_avg_sq: fp32, updated in place. step: the step count after incrementing (>= 1),
    a number, or a 0-d tensor on param's device that the kernel reads (fp16's counts, which a
    skipped step does not advance: only the device knows them).
    param_out: optional tensor of the same numel (fp16/bf16/fp32) that receives the updated
    param, cast, in the same pass.
    found_inf: None, or a 0-d fp32 tensor on param's device (fp16's overflow, as torch's fused
    AdamW takes it): where it is nonzero the update writes nothing (param, exp_avg, exp_avg_sq, param_out).
    kernel: "auto" (triton when param is on CUDA and triton imports, else torch) | "triton" | "torch"
    | "fused" (torch's fused AdamW kernel, fused.py).
    """
    _check_kernel(kernel)
    tensors = [param, grad, exp_avg, exp_avg_sq] + ([] if param_out is None else [param_out])
    if any(t.dim() != 1 or not t.is_contiguous() or t.numel() != param.numel() for t in tensors):
        raise ValueError("adamw_update_ expects contiguous 1-D tensors of equal numel")
    if any(t.device != param.device for t in tensors):
        raise ValueError("adamw_update_ expects all tensors on the same device")
    if not (param.dtype == exp_avg.dtype == exp_avg_sq.dtype == torch.float32):
        raise ValueError("param, exp_avg and exp_avg_sq must be fp32")
    if not isinstance(step, torch.Tensor) and step < 1:
        raise ValueError(f"step must be >= 1 (the count after incrementing), got {step}")

    if kernel == "auto":
        kernel = "triton" if param.is_cuda and _triton_importable() else "torch"
    if kernel == "torch":
        update = torch_adamw_update_
    elif kernel == "fused":
        from .fused import fused_adamw_update_ as update
    else:
        if not param.is_cuda and not _triton_interpret():
            raise RuntimeError("the triton AdamW kernel needs CUDA tensors, or TRITON_INTERPRET=1 "
                               "(set before triton is imported) to run on CPU in Triton's interpreter")
        from .kernel import triton_adamw_update_ as update
    update(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
           weight_decay=weight_decay, step=step, grad_scale=grad_scale, param_out=param_out, found_inf=found_inf)


def check_hparams(lr, betas, eps, weight_decay):
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas}")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_group(group):
    """A param group (defaults filled in), as it is added: its hyperparameters
    as torch.optim.AdamW checks them, and check_options."""
    check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    check_options(group)


def check_options(group):
    """None of torch.optim.AdamW's options that tiny_zero's AdamW lacks, which
    it would otherwise ignore without a word. Also checked at every step: a
    group may change after it is added (load_state_dict of a torch checkpoint)."""
    for option in ("amsgrad", "maximize"):
        if group.get(option):
            raise ValueError(f"tiny_zero's AdamW has no {option}: a param group sets {option}=True")


def scales(grad_scale):
    """grad_scale changes the grads: a tensor (a clip coefficient, kept on the
    device: comparing it with 1 would wait for the device), or a number other than 1."""
    return isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0


def torch_adamw_update_(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                        grad_scale=1.0, param_out=None, found_inf=None):
    """One AdamW step on flat fp32 `param`, `exp_avg`, `exp_avg_sq` (updated in place).

    `grad` may be fp32/fp16/bf16; the step uses g = grad.float() * grad_scale.
    `step` is the step count after incrementing (>= 1): a number, or a 0-d tensor on the
    device (fp16's counts, which only the device knows). If given, `param_out` receives the new
    param cast to its own dtype. Where `found_inf` (a 0-d tensor) is nonzero, nothing changes.
    """
    if found_inf is not None:  # the skip is the device's: step, then put back what was there
        before = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
        torch_adamw_update_(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay, step=step, grad_scale=grad_scale)
        skip = found_inf != 0
        for t, old in zip((param, exp_avg, exp_avg_sq), before):
            t.copy_(torch.where(skip, old, t))
        if param_out is not None:
            param_out.copy_(param)
        return
    if isinstance(step, torch.Tensor):  # computed on the device, in fp64 as on the host
        step = step.double()
        step_size = -lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step).sqrt()
    else:  # Host-side scalars, once per call.
        step_size = -lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5

    g = grad.float()  # no copy when grad is already fp32
    if scales(grad_scale):
        g = g * grad_scale  # out of place: never modify the caller's grad

    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)                      # p *= 1 - lr * wd   (decoupled decay)
    exp_avg.lerp_(g, 1 - beta1)                                # m = beta1 * m + (1 - beta1) * g
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)     # v = beta2 * v + (1 - beta2) * g * g
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)  # sqrt(v) / sqrt(bc2) + eps
    if isinstance(step_size, torch.Tensor):
        param.addcmul_(exp_avg / denom, step_size.float())     # p -= lr / bc1 * m / denom
    else:
        param.addcdiv_(exp_avg, denom, value=step_size)        # p -= lr / bc1 * m / denom

    if param_out is not None:
        param_out.copy_(param)


def torch_adamw_update_many_(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, steps,
                             grad_scale=1.0):
    """torch_adamw_update_ on lists of fp32 tensors (steps: each one's count), with torch's
    multi-tensor (foreach) ops: one call per formula line for the whole list, the same
    element-wise math, so the results are bit-identical to a loop of torch_adamw_update_."""
    step_sizes = [-lr / (1 - beta1 ** step) for step in steps]
    bias_correction2_sqrts = [(1 - beta2 ** step) ** 0.5 for step in steps]

    g = [grad.float() for grad in grads]
    if scales(grad_scale):
        g = torch._foreach_mul(g, grad_scale)

    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, g, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=1 - beta2)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, bias_correction2_sqrts)
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)
