"""The norms' Triton kernels: the same math as LayerNorm's and RMSNorm's
hand-written forward and backward (layers.py, more_layers.py), in fewer
passes over memory, used on CUDA where layers.fused_norms_apply says so
(layers.py also picks torch's own native_layer_norm on the CPU).

Statistics are in fp32 whatever the input dtype, as in the reference. One
Triton program normalises one row (the last dimension, at most MAX_ROW
elements); in backward each program also sums the weight's (and bias's)
grad over a block of rows, and those partial sums are added up by torch
afterwards, the weight's and the bias's in one sum and one cast. Triton is
imported on first use, so this module works where it is missing.
"""
import contextlib
import functools

import torch

MAX_ROW = 65536  # elements of one row a Triton program holds at once
ROWS_PER_PROGRAM = 64  # rows a backward program walks, summing their weight grads


# ---------------------------------------------------------------- Triton

@functools.lru_cache(maxsize=None)
def kernels():
    """The kernels, compiled on first use; None where triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception:
        return None

    @triton.jit
    def forward(X, Y, W, B, Mean, Rstd, n, eps, offset, RMS: tl.constexpr, HAS_W: tl.constexpr,
                HAS_B: tl.constexpr, CAST_FIRST: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(X + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        if RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=0) / n
            xc = tl.where(mask, x - mean, 0.0)
            tl.store(Mean + row, mean)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n + eps)  # 1 / σ (or 1 / rms)
        y = xc * rstd  # x̂
        if CAST_FIRST:  # Hugging Face's RMSNorm scales x̂ rounded to the input's dtype
            y = y.to(Y.dtype.element_ty).to(tl.float32)
        if HAS_W:
            y = y * (tl.load(W + cols, mask=mask).to(tl.float32) + offset)
        if HAS_B:
            y = y + tl.load(B + cols, mask=mask).to(tl.float32)
        tl.store(Y + row * n + cols, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(Rstd + row, rstd)

    @triton.jit
    def backward(DY, X, W, Mean, Rstd, DX, DW, DB, rows, n, offset, RMS: tl.constexpr, HAS_W: tl.constexpr,
                 NEED_DX: tl.constexpr, CAST_FIRST: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        program = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        w = tl.load(W + cols, mask=mask).to(tl.float32) + offset if HAS_W else 1.0
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ROWS):
            row = program.to(tl.int64) * ROWS + i
            live = mask & (tl.full([BLOCK], row, tl.int64) < rows)  # this column, and a real row
            x = tl.load(X + row * n + cols, mask=live, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * n + cols, mask=live, other=0.0).to(tl.float32)
            last = tl.minimum(row, rows - 1)  # past the last row, x and dy are 0 (live): nothing adds up
            rstd = tl.load(Rstd + last)
            mean = 0.0 if RMS else tl.load(Mean + last)
            xhat = tl.where(live, (x - mean) * rstd, 0.0)
            if CAST_FIRST:
                dw += dy * xhat.to(DY.dtype.element_ty).to(tl.float32)  # dw = Σ dy cast(x̂)
            else:
                dw += dy * xhat  # dγ = Σ dy x̂
            db += dy  # dβ = Σ dy
            if NEED_DX:
                g = dy * w
                if CAST_FIRST:  # dL/dcast(x̂), rounded as autograd rounds it
                    g = g.to(DY.dtype.element_ty).to(tl.float32)
                c = tl.sum(g * xhat, axis=0) / n
                if RMS:
                    dx = (g - xhat * c) * rstd  # dx = (g - x̂ mean(g x̂)) / rms
                else:
                    dx = (g - tl.sum(g, axis=0) / n - xhat * c) * rstd  # dx = (g - mean(g) - x̂ mean(g x̂)) / σ
                tl.store(DX + row * n + cols, dx.to(DX.dtype.element_ty), mask=live)
        tl.store(DW + program * n + cols, dw, mask=mask)
        tl.store(DB + program * n + cols, db, mask=mask)

    return triton, forward, backward


def launch_forward(x, weight, bias, eps, rms, cast_first=False, offset=0.0):
    triton, forward, _ = kernels()
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    rows = x2.shape[0]
    y = torch.empty_like(x2)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    with _on(x):
        forward[(rows,)](x2, y, _or(weight, x2), _or(bias, x2), mean, rstd, n, eps, float(offset), RMS=rms,
                         HAS_W=weight is not None, HAS_B=bias is not None, CAST_FIRST=cast_first,
                         BLOCK=triton.next_power_of_2(n))
    return y.view(x.shape), mean.view(*x.shape[:-1], 1), rstd.view(*x.shape[:-1], 1)


def launch_backward(grad_out, x, weight, bias, mean, rstd, needs, rms, cast_first=False, offset=0.0):
    triton, _, backward = kernels()
    n = x.shape[-1]
    x2, dy = x.reshape(-1, n).contiguous(), grad_out.reshape(-1, n).contiguous()
    rows = x2.shape[0]
    programs = triton.cdiv(rows, ROWS_PER_PROGRAM)
    dx = torch.empty_like(x2) if needs[0] else None
    parts = torch.empty(2, programs, n, dtype=torch.float32, device=x.device)  # each program's dw, db sums
    with _on(x):
        backward[(programs,)](dy, x2, _or(weight, x2), _or(mean, rstd), rstd, _or(dx, x2), parts[0], parts[1],
                              rows, n, float(offset), RMS=rms, HAS_W=weight is not None, NEED_DX=needs[0],
                              CAST_FIRST=cast_first, ROWS=ROWS_PER_PROGRAM, BLOCK=triton.next_power_of_2(n))
    dw = db = None
    if weight is not None and (needs[1] or needs[2]):  # one sum over the programs and one cast, for both
        sums = parts.sum(1).to(weight.dtype)  # the bias shares the weight's dtype (layers.fused_norms_apply)
        dw = sums[0] if needs[1] else None
        db = sums[1] if needs[2] and bias is not None else None
    elif needs[2] and bias is not None:
        db = parts[1].sum(0).to(bias.dtype)
    return (dx.view(x.shape) if dx is not None else None), dw, db


def _or(tensor, stand_in):
    """A pointer for the kernel where a tensor is absent (its flag keeps it unread)."""
    return stand_in if tensor is None else tensor


def _on(x):
    """Launch on x's GPU even when another one is current (the interpreter runs CPU tensors)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
