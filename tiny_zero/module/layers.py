"""Linear, LayerNorm and Embedding with their backward written out by hand
(RMSNorm and Conv1D: more_layers.py).

Each layer subclasses the torch layer it replaces (same constructor, same
parameter names, so state_dicts interchange) and runs one
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


# ---------------------------------------------------------------- the norms' fast path
# The same math as the hand-written LayerNorm below (and RMSNorm, more_layers.py), in fewer passes:
#   layer_norm / layer_norm_backward   CUDA: Triton kernels (fused.py); CPU: torch's own
#                                      native_layer_norm and its backward (fp32 input: for
#                                      bf16 it keeps bf16 statistics, the reference fp32 ones)
#   rms_norm / rms_norm_backward       more_layers.py (RMSNorm)

FUSED_NORMS = True  # False: the hand-written form everywhere (tests compare the two)


def fused_norms_apply(x, normalized_ndim, params=(), rms=False):
    """The fast path applies: enabled, one normalised dimension, a row that
    fits a program, a floating input whose dtype the parameters share (the
    reference handles the promotions of mixed dtypes); on the CPU, LayerNorm only."""
    if not FUSED_NORMS or normalized_ndim != 1 or not x.is_floating_point() or x.shape[-1] > fused.MAX_ROW:
        return False
    for p in params:
        if p is not None and p.dtype != x.dtype:
            return False
    if x.is_cuda:
        return fused.kernels() is not None
    return not rms and x.dtype == torch.float32  # torch's CPU kernel keeps bf16 statistics for bf16 input


def layer_norm(x, weight, bias, eps):
    """(y, mean, rstd): y as x's dtype; mean and rstd fp32, one per row."""
    if x.is_cuda:
        return fused.launch_forward(x, weight, bias, eps, rms=False)
    return torch.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)


def layer_norm_backward(grad_out, x, weight, bias, mean, rstd, needs):
    """(dx, dweight, dbias); `needs` says which of the three to compute."""
    if x.is_cuda:
        return fused.launch_backward(grad_out, x, weight, bias, mean, rstd, needs, rms=False)
    return torch.ops.aten.native_layer_norm_backward(grad_out, x, [x.shape[-1]], mean, rstd, weight, bias,
                                                     list(needs))


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


def as_rows(t, width):
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
        dy = as_rows(grad_out, self.out_features)
        if trains(ctx, weight):  # dW = dyᵀ x
            self.grad_ready(weight, torch.mm(dy.t(), as_rows(x, self.in_features),
                                             out=self.grad_place(ctx, weight, dy.dtype)))
        if trains(ctx, bias):  # db = Σ dy
            self.grad_ready(bias, torch.sum(dy, 0, out=self.grad_place(ctx, bias, dy.dtype)))
        return grad_x


def trains(ctx, param):
    """A parameter that exists, requires grad, and whose grad this backward
    fills: only those get a grad computed."""
    return param is not None and param.requires_grad and ctx.param_grads


def stats_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


class LayerNorm(CallbackLayer, nn.LayerNorm):
    def _dims(self):
        return tuple(range(-len(self.normalized_shape), 0))

    def forward_callback(self, ctx, x):
        weight, bias = self.weight, self.bias
        ctx.fused = not ctx.autocast and fused_norms_apply(x, len(self.normalized_shape), (weight, bias))
        if ctx.fused:  # the same math in fewer passes (fused.py); the lines below are its reference
            y, mean, rstd = layer_norm(x, weight, bias, self.eps)
            ctx.save_for_backward(x, mean, rstd)
            return y
        dims = self._dims()
        x32 = x.to(stats_dtype(x))  # statistics in fp32 (or fp64) for every input dtype
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
            grad_x, grad_w, grad_b = layer_norm_backward(grad_out, x, weight, bias, mean, rstd, needs)
            self._accumulate(weight, grad_w, bias, grad_b)
            return grad_x
        dims = self._dims()
        width = weight.numel() if weight is not None else None
        xhat = (x.to(mean.dtype) - mean) * rstd
        dy = grad_out.to(mean.dtype)
        grad_w = grad_b = None
        if trains(ctx, weight):
            grad_w = as_rows(dy * xhat, width).sum(0).view_as(weight)  # dγ = Σ dy x̂
        if trains(ctx, bias):
            grad_b = as_rows(dy, width).sum(0).view_as(bias)  # dβ = Σ dy
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
        grad_w.index_add_(0, idx.reshape(-1), as_rows(grad_out, self.embedding_dim))  # scatter-add rows
        if self.padding_idx is not None:
            grad_w[self.padding_idx] = 0  # the padding row never learns
        self.grad_ready(self.weight, grad_w)
        return None  # indices have no grad
