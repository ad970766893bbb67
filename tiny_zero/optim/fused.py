"""AdamW step through torch's own fused kernel (torch._fused_adamw_, what
torch.optim.AdamW(fused=True) runs): one vectorised pass over the parameter,
the grad and the moments, on torch's intra-op threads. It is the fastest
AdamW torch has on the CPU, so ZeRO-Offload steps on the host with it.

Same arguments and semantics as torch_adamw_update_ (adamw.py). The
kernel rounds two lines of the math in another order (v·β₂ + ((1−β₂)·g)·g,
and p + (−step_size·m)/denom where the reference has p + (−step_size)·(m/denom)),
so some elements (2 in 100 on an AVX2 CPU, fewer with AVX-512) end one fp32 ulp away from
torch.optim.AdamW(foreach=False) after a step; with torch.optim.AdamW(fused=True)
it agrees bit for bit (tests/test_offload.py).
"""
import torch

from .adamw import scales

# Elements per launch where the grad needs an fp32 copy (a low-precision grad,
# grad_scale != 1) or param_out is written: the copy stays small (no fresh
# pages to fault in at every step), and param_out is written from what the
# kernel has just left in the cache. On 16 cores, 2.2x faster under bf16 than
# one launch over 50M elements; a plain fp32 step is one launch.
BLOCK = 2**20


def fused_adamw_update_(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                        grad_scale=1.0, param_out=None, found_inf=None):
    # the kernel reads the count from a tensor: fp16's counts are one already (a view, on the host here)
    steps = [step.to(param.device).float() if isinstance(step, torch.Tensor) else
             torch.tensor(float(step), device=param.device)]
    if found_inf is not None:  # the kernel skips itself where it is nonzero
        found_inf = found_inf.to(param.device)
    plain = grad.dtype == torch.float32 and not scales(grad_scale) and param_out is None
    size = max(1, param.numel()) if plain else BLOCK
    for lo in range(0, param.numel(), size):
        block = slice(lo, lo + size)
        g = grad[block].float()  # the kernel wants the parameter's dtype; no copy when grad is already fp32
        if scales(grad_scale):
            g = g * grad_scale  # out of place, as the reference: never modify the caller's grad
        torch._fused_adamw_([param[block]], [g], [exp_avg[block]], [exp_avg_sq[block]], [], steps,
                            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                            amsgrad=False, maximize=False, found_inf=found_inf)
        if param_out is not None:  # under found_inf the param is as it was: so is its copy
            param_out[block].copy_(param[block])
