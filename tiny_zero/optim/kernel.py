"""Fused AdamW step as one Triton kernel.

Each element of param (fp32), grad (any float dtype), exp_avg and exp_avg_sq (fp32) is read
once and param, exp_avg, exp_avg_sq (and optionally a low-precision copy of param) are written
once, in a single pass; the grad cast and the low-precision cast happen in registers.

Bytes moved per element, fp32 grad: 4 reads x 4 B + 3 writes x 4 B = 28 B
(26 B with a bf16/fp16 grad; plus 2 B with a bf16/fp16 param_out, 4 B with an fp32 one).
With ~10 flops per element, the kernel is memory-bound: its time is bytes / memory bandwidth.

This module imports triton at the top, so only import it when the triton path is used
(tiny_zero.optim.adamw does that lazily).
"""

import contextlib
import math
import struct

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per program; the grid is cdiv(numel, BLOCK) with a masked tail
# 4 warps of 32 threads: 8 elements per thread, two 16-byte loads per fp32 tensor. Measured on an
# H100 (docs/benchmarks.md, "GPU"), this moves bytes as fast as a device-to-device copy from 100M
# elements up. Larger blocks, more warps and a persistent grid were no faster; and on a size that
# is not a multiple of 16 this one kept its speed where 4096 elements over 8 warps lost 6%.
NUM_WARPS = 4


@triton.jit
def _double(hi, lo):
    """A double from split()'s two halves."""
    return tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, n,
                  decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt,
                  grad_scale, found_inf, step, lr_hi, lr_lo, log_beta1_hi, log_beta1_lo, log_beta2_hi, log_beta2_lo,
                  SCALE_IN_MEMORY: tl.constexpr, FOUND_INF: tl.constexpr, STEP_IN_MEMORY: tl.constexpr,
                  HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: numel may exceed 2**31
    mask = offs < n
    if FOUND_INF:  # fp16's skip, decided on the device: where it is nonzero nothing is read or written
        mask = mask & (tl.load(found_inf + tl.zeros([BLOCK], tl.int32)) == 0)  # every lane reads the one value
    if SCALE_IN_MEMORY:  # a 0-d tensor on the device (a clip coefficient): read here, never by the host
        scale = tl.load(grad_scale)
    else:
        scale = grad_scale
    if STEP_IN_MEMORY:  # the step count, on the device (fp16): the bias corrections in fp64, as the host's
        count = tl.load(step).to(tl.float64)
        bias_correction1 = 1.0 - tl.exp(count * _double(log_beta1_hi, log_beta1_lo))  # 1 - beta1 ** count
        bias_correction2 = 1.0 - tl.exp(count * _double(log_beta2_hi, log_beta2_lo))
        step_size = (_double(lr_hi, lr_lo) / bias_correction1).to(tl.float32)
        bias_correction2_sqrt = tl.sqrt(bias_correction2).to(tl.float32)

    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * scale
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)

    p = p * decay                                   # p *= 1 - lr * wd
    m = m + one_minus_beta1 * (g - m)               # lerp(m, g, 1 - beta1), torch's form for beta1 > 0.5
    v = v * beta2 + one_minus_beta2 * g * g         # v = beta2 * v + (1 - beta2) * g * g
    # IEEE-rounded sqrt and division (tl.sqrt and `/` may be approximate on GPU), as torch computes them.
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)         # p -= lr / bc1 * m / denom

    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)


def split(x):
    """A double as two fp32 numbers whose sum in fp64 is x to about 48 bits:
    Triton takes Python floats as fp32 arguments."""
    hi = struct.unpack("f", struct.pack("f", x))[0]
    return hi, struct.unpack("f", struct.pack("f", x - hi))[0]


def triton_adamw_update_(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                         grad_scale=1.0, param_out=None, found_inf=None):
    """Launch the fused kernel; same arguments and semantics as torch_adamw_update_ (adamw.py)."""
    n = param.numel()
    if n == 0:
        return
    # Host-side scalars, once per call, in double precision as torch computes them
    # (float() so that Triton always sees fp32 arguments, never an int it would specialize on).
    scalars = dict(
        decay=float(1 - lr * weight_decay),
        one_minus_beta1=float(1 - beta1),
        beta2=float(beta2),
        one_minus_beta2=float(1 - beta2),
        eps=float(eps),
    )
    step_in_memory = isinstance(step, torch.Tensor)
    if step_in_memory:  # the kernel computes the step size and bias correction from the count it reads
        (lr_hi, lr_lo), (b1_hi, b1_lo), (b2_hi, b2_lo) = split(lr), split(math.log(beta1)), split(math.log(beta2))
        scalars.update(step_size=1.0, bias_correction2_sqrt=1.0, step=step, lr_hi=lr_hi, lr_lo=lr_lo,
                       log_beta1_hi=b1_hi, log_beta1_lo=b1_lo, log_beta2_hi=b2_hi, log_beta2_lo=b2_lo)
    else:
        scalars.update(step_size=float(lr / (1 - beta1 ** step)),
                       bias_correction2_sqrt=float((1 - beta2 ** step) ** 0.5),
                       step=param, lr_hi=0.0, lr_lo=0.0,  # step: a dummy pointer, as out below
                       log_beta1_hi=0.0, log_beta1_lo=0.0, log_beta2_hi=0.0, log_beta2_lo=0.0)
    scale_in_memory = isinstance(grad_scale, torch.Tensor)
    scalars["grad_scale"] = grad_scale.float() if scale_in_memory else float(grad_scale)
    scalars["found_inf"] = param if found_inf is None else found_inf
    out = param if param_out is None else param_out  # a dummy pointer when there is no param_out
    grid = (triton.cdiv(n, BLOCK),)
    # Launch on the tensors' GPU even when another one is current.
    with torch.cuda.device(param.device) if param.is_cuda else contextlib.nullcontext():
        _adamw_kernel[grid](param, grad, exp_avg, exp_avg_sq, out, n, **scalars, SCALE_IN_MEMORY=scale_in_memory,
                            FOUND_INF=found_inf is not None, STEP_IN_MEMORY=step_in_memory,
                            HAS_OUT=param_out is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)
