"""The second way to a strategy's moments: module hooks, for every module that
holds parameters and is not one of tiny_zero's layers (Conv2d, BatchNorm,
MultiheadAttention, a bare nn.Parameter, 3-D expert tensors, a norm class on
no list: module/swap.py's hooked_modules). As FSDP2 and DeepSpeed's ZeRO-3
reach any module, torch calls the moments around the module's own forward:

    forward pre-hook  expect_grads; before_layer (zero3, fsdp: gather its unit);
                      each parameter it owns is swapped, for this forward, for
                      a tensor of its values made by ParamUse, whose backward
                      hands the parameter's grad (autograd has summed its uses)
                      to grad_ready, as a custom layer's backward does
    forward hook      the parameters put back; after_layer (free); a hook on
                      its outputs, which runs as the backward reaches them
    backward          an output's grad: before_layer(backward=True) (gather
                      again); each parameter's grad: grad_ready; after the
                      last of them (no node reads the values after): after_layer

A strategy's folder fills in before_layer, after_layer and grad_ready once,
for both ways: its mixin serves step.StrategyLayer and HookedLayer alike.

The wrapped module itself, where it holds parameters of its own (CLIP's
logit_scale), runs the whole model in its forward: its parameters stay
gathered from its forward to the end of the backward, as FSDP2's root's.
While a hooked module runs, its units stay gathered (wrapper.running).
"""
import torch
from torch.utils._pytree import tree_flatten

from . import comm
from .module import in_backward_pass
from .module.layers import _LEAF


class ParamUse(torch.autograd.Function):
    """A parameter's values for one forward of a hooked module, as a tensor
    whose backward gives the parameter's grad to the strategy: the parameter
    itself stays out of autograd's graph, so autograd never writes p.grad."""

    @staticmethod
    def forward(ctx, use, i, values, leaf):
        ctx.use, ctx.i = use, i
        return values.view_as(values)  # the values gathered now; a backward reads them gathered again

    @staticmethod
    def backward(ctx, grad):
        ctx.use.grad_arrived(ctx.i, grad)
        return None, None, None, None


class Use:
    """One forward of a hooked module: its parameters' grads still to come."""

    def __init__(self, layer, backward_follows):
        self.layer, self.backward_follows, self.pending, self.started = layer, backward_follows, 0, False

    def output_grad(self, grad):
        """A hook on an output: the backward reached this module."""
        if not self.started:
            self.layer.backward_began(self)

    def grad_arrived(self, i, grad):
        layer = self.layer
        if not self.started:
            layer.backward_began(self)
        layer.grad_ready(layer.params[i], grad)  # moment: a grad ready
        self.pending -= 1
        if self.pending == 0:
            layer.backward_ended(self)


class HookedLayer:
    """What every strategy does around a hooked module, before its mixin:
    DDPHooked(HookedLayer, DDPLayer, LayerMoments). Not an nn.Module: the
    module keeps its class, its forward and its state_dict."""

    def __init__(self, wrapper, module, owned, whole_pass):
        self.wrapper, self.module = wrapper, module
        self.owned = owned  # [(holder, name, parameter)]: every place a parameter it owns is registered
        self.params = list({id(p): p for _, _, p in owned}.values())
        self.whole_pass = whole_pass  # the wrapped module: gathered from its forward to the backward's end
        self.use = None
        module.register_forward_pre_hook(self.forward_started, with_kwargs=True)
        module.register_forward_hook(self.forward_ended, with_kwargs=True, always_call=True)

    def parameters(self, recurse=False):
        return iter(self.params)

    def forward_started(self, module, args, kwargs):
        wrapper = self.wrapper
        comm.where = self.where_forward
        grads = torch.is_grad_enabled()
        # in a backward pass: a checkpoint's recompute, which must save what the forward saved (ParamUse's
        # outputs, which require grad); its graph is dropped, so no grad comes from it
        backward_follows = grads and not in_backward_pass() and (bool(self.trained) or requires_grad(args, kwargs))
        if backward_follows:
            wrapper.expect_grads(self, True)
        wrapper.running.append(self)  # its units stay gathered while it runs
        self.before_layer(backward_follows=backward_follows, backward=False)  # moment: before a layer computes
        use = self.use = Use(self, backward_follows)
        values = []
        for i, p in enumerate(self.params):
            if grads and p.requires_grad:
                values.append(ParamUse.apply(use, i, p.data, _LEAF))
                use.pending += 1
            else:
                values.append(p.detach())
        value_of = {id(p): v for p, v in zip(self.params, values)}
        for holder, name, p in self.owned:
            holder._parameters[name] = value_of[id(p)]  # what its forward reads, for this forward only

    def forward_ended(self, module, args, kwargs, output):
        wrapper, use = self.wrapper, self.use
        for holder, name, p in self.owned:
            holder._parameters[name] = p
        if self.whole_pass and use.backward_follows:
            return output  # stays gathered and running, to the backward's end (backward_done)
        wrapper.running.remove(self)
        self.after_layer()  # moment: after it computed
        if use.backward_follows:  # its backward reads the values too, frozen ones included
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(use.output_grad)
        return output

    def backward_began(self, use):
        wrapper = self.wrapper
        use.started = True
        comm.where = self.where_backward
        if not wrapper.in_backward:  # the pass's first layer backward
            wrapper.backward_started()
        if self.whole_pass:
            return  # gathered since its forward
        wrapper.skip_to(self)
        if use.pending:  # until its last grad (frozen: until another layer frees its unit)
            wrapper.running.append(self)
        self.before_layer(backward_follows=False, backward=True)  # moment: before a layer computes, in backward

    def backward_ended(self, use):
        if self.whole_pass:
            return
        self.wrapper.running.remove(self)
        self.after_layer()  # moment: after it computed


def requires_grad(args, kwargs):
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten((args, kwargs))[0])
