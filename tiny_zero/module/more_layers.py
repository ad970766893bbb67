"""RMSNorm and Conv1D, the layers of the models people bring beyond
torch.nn's Linear, LayerNorm and Embedding, on the same CallbackLayer as
those (layers.py): RMSNorm as torch's nn.RMSNorm and as Hugging Face's
Llama, Qwen, Mistral, Gemma and T5 compute it; Conv1D as transformers'
(GPT-2). Only RMSNorm has a fast path here: the Triton kernels, on CUDA."""
import math

import torch
import torch.nn as nn

from . import fused
from .layers import CallbackLayer, as_rows, stats_dtype, fused_norms_apply, trains


def rms_norm(x, weight, eps, cast_first=False, offset=0.0):
    """(y, rstd), y = x̂ (w + offset), or (w + offset) cast(x̂) with cast_first: CUDA only."""
    y, _, rstd = fused.launch_forward(x, weight, None, eps, rms=True, cast_first=cast_first, offset=offset)
    return y, rstd


def rms_norm_backward(grad_out, x, weight, rstd, needs, cast_first=False, offset=0.0):
    """(dx, dweight): CUDA only."""
    dx, dw, _ = fused.launch_backward(grad_out, x, weight, None, None, rstd, (*needs, False), rms=True,
                                 cast_first=cast_first, offset=offset)
    return dx, dw


class RMSNorm(CallbackLayer, nn.RMSNorm):
    """y = x̂ w with x̂ = x / rms(x), rms(x) = sqrt(mean(x²) + eps), statistics in fp32.

    Implementations differ in where the result is cast back to the input
    dtype (bf16/fp16 only) and in the scale; three attributes follow the layer
    being replaced (tiny_zero/module/swap.py sets them on adapted layers):
      cast_before_scale  False: torch's nn.RMSNorm, x̂ w in fp32, then the cast.
                         True: the RMSNorm of Hugging Face's Llama, Qwen and
                         Mistral, w · cast(x̂), whose product may promote (an
                         fp32 w times a bf16 x̂ is fp32).
      cast_to_weight_dtype  with cast_before_scale, T5's LayerNorm: the cast
                         is to w's dtype where w is fp16 or bf16, and none
                         otherwise (x̂ stays fp32), whatever the input's dtype.
      weight_offset      1.0 for Gemma's RMSNorm, which scales x̂ by 1 + w.
    """
    cast_before_scale = False
    cast_to_weight_dtype = False
    weight_offset = 0.0

    def _dims(self):
        return tuple(range(-len(self.normalized_shape), 0))

    def _cast(self, xhat, x):
        """cast(x̂) of cast_before_scale: to the input's dtype, or as T5 casts."""
        if not self.cast_to_weight_dtype:
            return xhat.to(x.dtype)
        return xhat.to(self.weight.dtype) if self.weight.dtype in (torch.float16, torch.bfloat16) else xhat

    def _scale(self, dtype):
        """What x̂ is multiplied by, in `dtype`: w, or Gemma's 1 + w (added in fp32)."""
        return self.weight.to(dtype) + self.weight_offset

    def forward_callback(self, ctx, x):
        x32 = x.to(stats_dtype(x))  # statistics in fp32 (or fp64) for every input dtype
        eps = self.eps if self.eps is not None else torch.finfo(x32.dtype).eps  # torch's default
        ctx.fused = not ctx.autocast and fused_norms_apply(x, len(self.normalized_shape), (self.weight,), rms=True)
        if ctx.fused:  # the same math in fewer passes (fused.py, CUDA); the lines below are its reference
            y, rstd = rms_norm(x, self.weight, eps, self.cast_before_scale, self.weight_offset)
            ctx.save_for_backward(x, rstd)
            return y
        rstd = torch.rsqrt(x32.pow(2).mean(self._dims(), keepdim=True) + eps)  # 1 / rms
        ctx.save_for_backward(x, rstd)
        xhat = x32 * rstd
        if self.weight is None:
            return xhat.to(x.dtype)
        if self.cast_before_scale:
            return self.weight * self._cast(xhat, x)
        return (xhat * self._scale(xhat.dtype)).to(x.dtype)

    def backward_callback(self, ctx, grad_out):
        x, rstd = ctx.saved
        if ctx.fused:
            needs = (ctx.needs_input_grad[1], trains(ctx, self.weight))
            grad_x, grad_w = rms_norm_backward(grad_out, x, self.weight, rstd, needs, self.cast_before_scale,
                                                     self.weight_offset)
            if grad_w is not None:
                self.grad_ready(self.weight, grad_w)
            return grad_x
        xhat = x.to(rstd.dtype) * rstd
        width = math.prod(self.normalized_shape)
        if self.weight is None:
            g = grad_out.to(rstd.dtype)
        elif self.cast_before_scale:  # y = w h with h = cast(x̂)
            h = self._cast(xhat, x)
            if trains(ctx, self.weight):  # dw = Σ dy h
                self.grad_ready(self.weight, as_rows(grad_out * h, width).sum(0).view_as(self.weight))
            g = (grad_out * self.weight).to(h.dtype).to(rstd.dtype)  # dh = dy w, rounded to h's dtype as autograd does
        else:  # y = cast(x̂ s) with s = w + offset in fp32
            dy = grad_out.to(rstd.dtype)
            if trains(ctx, self.weight):  # dw = Σ dy x̂
                self.grad_ready(self.weight, as_rows(dy * xhat, width).sum(0).view_as(self.weight))
            g = dy * self._scale(dy.dtype)
        if not ctx.needs_input_grad[1]:
            return None
        # g = dL/dx̂; x̂ = x / rms(x) moves with every x_j through rms: dx = (g - x̂ mean(g x̂)) / rms
        grad_x = rstd * (g - xhat * (g * xhat).mean(self._dims(), keepdim=True))
        return grad_x.to(x.dtype)


class Conv1D(CallbackLayer, nn.Module):
    """transformers' Conv1D, GPT-2's attention and MLP projection: y = x W + b
    with W stored as [in, out] (nx inputs, nf outputs), the transpose of
    nn.Linear's. Its constructor and state_dict are transformers', so GPT-2
    checkpoints load either way (tiny_zero does not import transformers)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def extra_repr(self):
        return f"nf={self.nf}, nx={self.nx}"

    def forward_callback(self, ctx, x):
        ctx.save_for_backward(x)
        y = torch.addmm(self.bias, as_rows(x, self.nx), self.weight)  # y = b + x W, one fused op
        return y.view(*x.shape[:-1], self.nf)

    def backward_callback(self, ctx, grad_out):
        (x,) = ctx.saved
        grad_x = grad_out @ self.weight.t() if ctx.needs_input_grad[1] else None  # dx = dy Wᵀ
        dy = as_rows(grad_out, self.nf)
        weight, bias = self.weight, self.bias
        if trains(ctx, weight):  # dW = xᵀ dy, [in, out]
            self.grad_ready(weight, torch.mm(as_rows(x, self.nx).t(), dy, out=self.grad_place(ctx, weight, dy.dtype)))
        if trains(ctx, bias):  # db = Σ dy
            self.grad_ready(bias, torch.sum(dy, 0, out=self.grad_place(ctx, bias, dy.dtype)))
        return grad_x
