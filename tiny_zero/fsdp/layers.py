"""FSDP layers: around each layer's math, in forward and again in backward,
its unit is all-gathered before (the next layer's is already on the way) and
freed after; the gather and the free happen at a unit's first and last layer,
the layers between find it gathered. A grad goes into its unit's temporary
buffer; a unit whose grads are final is reduce-scattered at once,
asynchronously (wrapper.py). At world 1 nothing is gathered or freed.

Compare with ../zero3/layers.py: the same gather, compute, free; only how a
layer is gathered and where its grads go differ, in wrapper.py."""
from ..module import expects_backward
from ..strategy import layer_classes


class FSDPLayer:
    def forward_callback(self, ctx, x):
        fsdp = self.wrapper
        if fsdp.gathers:
            fsdp.unshard(self, training=expects_backward(ctx))  # STRATEGY: gather: all-gather the unit
        y = super().forward_callback(ctx, x)
        if fsdp.gathers:
            fsdp.reshard(self)  # STRATEGY: free: nothing full is kept for backward
        return y

    def backward_callback(self, ctx, grad_out):
        fsdp = self.wrapper
        if fsdp.gathers:
            fsdp.unshard(self, backward=True)  # STRATEGY: gathered again
        grad_in = super().backward_callback(ctx, grad_out)
        if fsdp.gathers:
            fsdp.reshard(self)  # STRATEGY: and freed again
        return grad_in

    def accumulate_grad(self, param, grad):
        fsdp = self.wrapper
        for unit in fsdp.buckets.add(param, grad, send=fsdp.require_grad_sync):
            fsdp.reduce_scatter(unit)  # STRATEGY: now, async; backward goes on


LAYER_CLASSES = layer_classes(FSDPLayer)  # FSDPLinear, FSDPLayerNorm, FSDPEmbedding, ...
