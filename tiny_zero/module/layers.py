"""Linear, LayerNorm, RMSNorm, Embedding and Conv1D with their backward
written out by hand.

Each layer subclasses the torch layer it replaces (same constructor, same
parameter names, so state_dicts interchange; Conv1D, which torch lacks, has
the constructor and layout of transformers' Conv1D) and runs one
autograd.Function:

    forward  -> layer.forward_callback(ctx, x)      returns the output
    backward -> layer.backward_callback(ctx, grad)  returns the input's grad and
                hands each parameter's grad to layer.grad_ready(param, g)

A strategy subclasses a layer and overrides these three methods to add
communication: gather the weights before the math, free them after, and send
each gradient away as soon as it is final. The parameters are not inputs of
the Function: their grads are delivered by grad_ready, never by
autograd, so a strategy decides where a gradient lives (and runs the
parameters' grad hooks, as autograd would: run_grad_hooks). One leaf that all
layers share is the Function's input instead: it makes the output require
grad where a parameter does, and it tells a backward that fills p.grad
(loss.backward()) from torch.autograd.grad, which does not.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fused
from .hooks import check_no_grad_hooks


def in_backward_pass():
    """True while autograd's engine runs a backward pass (in this thread)."""
    return torch._C._current_graph_task_id() != -1


def expects_backward(ctx):
    """A forward that a backward may follow: an input requires grad, and it is
    not a recompute inside backward (activation checkpointing), whose
    parameters get no extra grad contribution. Under torch.no_grad() too: a
    reentrant checkpoint runs its block's forward so, and backward recomputes it
    (there CallbackLayer.forward passes _LEAF, an input that requires grad)."""
    return any(ctx.needs_input_grad) and not in_backward_pass()


def recorded(ctx):
    """autograd recorded this forward: a backward through it can follow (not
    so under torch.no_grad(), an evaluation's forward)."""
    return bool(ctx.next_functions)


# A leaf that every layer's Function takes as an input where autograd records
# it. Its AccumulateGrad node runs in a backward pass that fills every leaf's
# .grad (loss.backward()), not in torch.autograd.grad(out, x) or
# backward(inputs=...), where torch's own layers leave p.grad alone.
_LEAF = torch.zeros((), device="cpu", requires_grad=True)
_LEAF_NODE = torch.autograd.graph.get_gradient_edge(_LEAF).node  # held, so the leaf keeps this one node


def fills_param_grads():
    """In a layer's backward: True under loss.backward(), False under
    torch.autograd.grad or backward(inputs=...)."""
    return torch._C._will_engine_execute_node(_LEAF_NODE)


class LayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, x, *params):
        ctx.layer = layer
        # torch.autocast: backward runs under the autocast state of its forward
        # (as torch.amp.custom_bwd does), so both compute in the same dtypes
        ctx.autocast = None
        if torch._C._is_any_autocast_enabled():  # one cheap call when autocast is off
            device = x.device.type
            if torch.is_autocast_enabled(device):
                ctx.autocast = (device, torch.get_autocast_dtype(device))
        return layer.forward_callback(ctx, x)

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # before any collective: every rank raises alike
            raise RuntimeError(f"{type(ctx.layer).__name__}: a backward with create_graph=True (a gradient penalty, "
                               "a double backward) is not supported: tiny_zero's layers compute their backward by "
                               "hand, and it cannot be differentiated again")
        ctx.param_grads = fills_param_grads()  # False: the caller wants other grads than the parameters'
        # Unpack the saved tensors first, once. Under activation checkpointing
        # this is what recomputes the block, whose forward callbacks gather and
        # free parameters on their own: that must end before this layer's
        # backward_callback gathers its own.
        ctx.saved = ctx.saved_tensors
        if ctx.autocast:
            with torch.autocast(*ctx.autocast):
                grad_in = ctx.layer.backward_callback(ctx, grad_out)
        else:
            grad_in = ctx.layer.backward_callback(ctx, grad_out)
        ctx.saved = None  # free the activations now, not when the whole graph goes
        return (None, grad_in) + (None,) * (len(ctx.needs_input_grad) - 2)  # no grad for the layer, the parameters


# autograd's C++ apply, without torch.autograd.Function.apply's Python wrapper
# (it only matters under functorch transforms; CallbackLayer.forward checks)
_apply = super(torch.autograd.Function, LayerFunction).apply


class CallbackLayer:
    """The part every custom layer shares: the autograd plumbing and the
    default gradient sink. Mixed into every layer below."""

    def forward(self, x):
        # torch.compile runs tiny_zero layers eagerly, as calls between its graphs:
        # their callbacks hold Python state (buckets, gathers) that a graph cannot.
        # Only then through torch.compiler.disable, whose wrapper costs an eager
        # call a third of its host time
        if torch.compiler.is_compiling():
            return self._forward_eagerly(x)
        # the leaf makes the output require grad (an embedding's indices, a first
        # layer's input do not); nothing that requires grad: no backward recorded.
        # The leaf also under torch.no_grad(), where nothing is recorded: a
        # reentrant checkpoint runs its block so, and backward then runs back
        # through every layer of it, frozen ones too, whose inputs no_grad
        # stripped of requires_grad; so this forward too expects_backward
        needs_leaf = x.requires_grad or not torch.is_grad_enabled() or self.autograd_params()
        inputs = (_LEAF,) if needs_leaf else ()
        if torch._C._are_functorch_transforms_active():
            return LayerFunction.apply(self, x, *inputs)
        return _apply(self, x, *inputs)

    @torch.compiler.disable
    def _forward_eagerly(self, x):
        return CallbackLayer.forward(self, x)  # not compiling in here: the eager path above

    def autograd_params(self):
        """The parameters that require grad."""
        return [p for p in self._parameters.values() if p is not None and p.requires_grad]

    def grad_place(self, ctx, param, dtype):
        """Where this backward may compute param's grad (out=), in `dtype`, to
        hand it to grad_ready there; None: in a new tensor. A strategy may
        give the place it keeps the grad in (step.py); here, always None."""
        return None

    def grad_ready(self, param, grad):
        """Default sink: add into param.grad, as autograd would. Called only
        for parameters that require grad (a frozen one's grad is never computed)."""
        check_no_grad_hooks(param)
        if grad.dtype != param.dtype:
            grad = grad.to(param.dtype)
        if param.grad is None:
            param.grad = grad.contiguous()
        else:
            param.grad += grad


def _rows(t, width):
    """View any number of leading dims as one: (..., width) -> (rows, width)."""
    return t.reshape(-1, width)


class Linear(CallbackLayer, nn.Linear):
    def forward_callback(self, ctx, x):
        ctx.save_for_backward(x)  # the weight is read again in backward, never saved
        return F.linear(x, self.weight, self.bias)  # y = x Wᵀ + b: one addmm (autograd is off in here)

    def backward_callback(self, ctx, grad_out):
        (x,) = ctx.saved
        weight, bias = self.weight, self.bias
        grad_x = grad_out @ weight if ctx.needs_input_grad[1] else None  # dx = dy W
        dy = _rows(grad_out, self.out_features)
        if trains(ctx, weight):  # dW = dyᵀ x
            self.grad_ready(weight, torch.mm(dy.t(), _rows(x, self.in_features),
                                             out=self.grad_place(ctx, weight, dy.dtype)))
        if trains(ctx, bias):  # db = Σ dy
            self.grad_ready(bias, torch.sum(dy, 0, out=self.grad_place(ctx, bias, dy.dtype)))
        return grad_x


def trains(ctx, param):
    """A parameter that exists, requires grad, and whose grad this backward
    fills: only those get a grad computed."""
    return param is not None and param.requires_grad and ctx.param_grads


def _stats_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


class LayerNorm(CallbackLayer, nn.LayerNorm):
    def _dims(self):
        return tuple(range(-len(self.normalized_shape), 0))

    def forward_callback(self, ctx, x):
        weight, bias = self.weight, self.bias
        ctx.fused = not ctx.autocast and fused.available(x, len(self.normalized_shape), (weight, bias))
        if ctx.fused:  # the same math in fewer passes (fused.py); the lines below are its reference
            y, mean, rstd = fused.layer_norm(x, weight, bias, self.eps)
            ctx.save_for_backward(x, mean, rstd)
            return y
        dims = self._dims()
        x32 = x.to(_stats_dtype(x))  # statistics in fp32 (or fp64) for every input dtype
        mean = x32.mean(dims, keepdim=True)
        centred = x32 - mean
        rstd = torch.rsqrt(centred.square().mean(dims, keepdim=True) + self.eps)  # 1 / σ
        ctx.save_for_backward(x, mean, rstd)
        y = centred * rstd  # x̂ = (x - μ) / σ
        if weight is not None:
            y = y * weight.to(y.dtype)  # y = x̂ γ + β
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y if ctx.autocast else y.to(x.dtype)  # autocast runs layer_norm in fp32, output too

    def backward_callback(self, ctx, grad_out):
        x, mean, rstd = ctx.saved
        weight, bias = self.weight, self.bias
        if ctx.fused:
            needs = (ctx.needs_input_grad[1], trains(ctx, weight), trains(ctx, bias))
            grad_x, grad_w, grad_b = fused.layer_norm_backward(grad_out, x, weight, bias, mean, rstd, needs)
            self._accumulate(weight, grad_w, bias, grad_b)
            return grad_x
        dims = self._dims()
        width = weight.numel() if weight is not None else None
        xhat = (x.to(mean.dtype) - mean) * rstd
        dy = grad_out.to(mean.dtype)
        grad_w = grad_b = None
        if trains(ctx, weight):
            grad_w = _rows(dy * xhat, width).sum(0).view_as(weight)  # dγ = Σ dy x̂
        if trains(ctx, bias):
            grad_b = _rows(dy, width).sum(0).view_as(bias)  # dβ = Σ dy
        self._accumulate(weight, grad_w, bias, grad_b)
        if not ctx.needs_input_grad[1]:
            return None
        g = dy * weight.to(dy.dtype) if weight is not None else dy
        # dx = (g - mean(g) - x̂ mean(g x̂)) / σ
        grad_x = rstd * (g - g.mean(dims, keepdim=True) - xhat * (g * xhat).mean(dims, keepdim=True))
        return grad_x.to(x.dtype)

    def _accumulate(self, weight, grad_w, bias, grad_b):
        if grad_w is not None:
            self.grad_ready(weight, grad_w)
        if grad_b is not None:
            self.grad_ready(bias, grad_b)


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
        x32 = x.to(_stats_dtype(x))  # statistics in fp32 (or fp64) for every input dtype
        eps = self.eps if self.eps is not None else torch.finfo(x32.dtype).eps  # torch's default
        ctx.fused = not ctx.autocast and fused.available(x, len(self.normalized_shape), (self.weight,), rms=True)
        if ctx.fused:  # the same math in fewer passes (fused.py, CUDA); the lines below are its reference
            y, rstd = fused.rms_norm(x, self.weight, eps, self.cast_before_scale, self.weight_offset)
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
            grad_x, grad_w = fused.rms_norm_backward(grad_out, x, self.weight, rstd, needs, self.cast_before_scale,
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
                self.grad_ready(self.weight, _rows(grad_out * h, width).sum(0).view_as(self.weight))
            g = (grad_out * self.weight).to(h.dtype).to(rstd.dtype)  # dh = dy w, rounded to h's dtype as autograd does
        else:  # y = cast(x̂ s) with s = w + offset in fp32
            dy = grad_out.to(rstd.dtype)
            if trains(ctx, self.weight):  # dw = Σ dy x̂
                self.grad_ready(self.weight, _rows(dy * xhat, width).sum(0).view_as(self.weight))
            g = dy * self._scale(dy.dtype)
        if not ctx.needs_input_grad[1]:
            return None
        # g = dL/dx̂; x̂ = x / rms(x) moves with every x_j through rms: dx = (g - x̂ mean(g x̂)) / rms
        grad_x = rstd * (g - xhat * (g * xhat).mean(self._dims(), keepdim=True))
        return grad_x.to(x.dtype)


class Embedding(CallbackLayer, nn.Embedding):
    def forward_callback(self, ctx, idx):
        if self.max_norm is not None or self.scale_grad_by_freq or self.sparse:
            raise NotImplementedError("tiny_zero Embedding supports padding_idx only "
                                      "(no max_norm, scale_grad_by_freq or sparse)")
        ctx.save_for_backward(idx)
        return self.weight.index_select(0, idx.reshape(-1)).view(*idx.shape, self.embedding_dim)  # a row lookup

    def backward_callback(self, ctx, grad_out):
        if not trains(ctx, self.weight):
            return None
        (idx,) = ctx.saved
        grad_w = self.grad_place(ctx, self.weight, grad_out.dtype)  # zeros there, or new ones
        if grad_w is None:
            grad_w = torch.zeros(self.weight.shape, dtype=grad_out.dtype, device=grad_out.device)
        grad_w.index_add_(0, idx.reshape(-1), _rows(grad_out, self.embedding_dim))  # scatter-add rows
        if self.padding_idx is not None:
            grad_w[self.padding_idx] = 0  # the padding row never learns
        self.grad_ready(self.weight, grad_w)
        return None  # indices have no grad


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
        y = torch.addmm(self.bias, _rows(x, self.nx), self.weight)  # y = b + x W, one fused op
        return y.view(*x.shape[:-1], self.nf)

    def backward_callback(self, ctx, grad_out):
        (x,) = ctx.saved
        grad_x = grad_out @ self.weight.t() if ctx.needs_input_grad[1] else None  # dx = dy Wᵀ
        dy = _rows(grad_out, self.nf)
        weight, bias = self.weight, self.bias
        if trains(ctx, weight):  # dW = xᵀ dy, [in, out]
            self.grad_ready(weight, torch.mm(_rows(x, self.nx).t(), dy, out=self.grad_place(ctx, weight, dy.dtype)))
        if trains(ctx, bias):  # db = Σ dy
            self.grad_ready(bias, torch.sum(dy, 0, out=self.grad_place(ctx, bias, dy.dtype)))
        return grad_x
