"""AdamW step in plain torch: in-place ops on flat tensors, one op per formula line.

This is the path used on CPU and the readable statement of the math that the Triton
kernel (kernel.py) fuses into one pass. The op sequence mirrors torch.optim.AdamW's
single-tensor implementation, so on the same device the results are bit-identical.
"""

import torch


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
