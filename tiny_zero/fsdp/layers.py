"""FSDP layers: around each layer's math, in forward and again in backward,
its unit is all-gathered before (the next layer's is already on the way) and
freed after; the gather and the free happen at a unit's first and last layer,
the layers between find it gathered. A grad goes into its unit's temporary
buffer; a unit whose grads are final is reduce-scattered at once,
asynchronously (wrapper.py). At world 1 nothing is gathered or freed.

Compare with ../zero3/layers.py: the same gather, compute, free; only how a
unit is gathered and where its grads go differ, in wrapper.py."""
from ..step import layer_classes


class FSDPLayer:
    def before_layer(self, training, backward):
        fsdp = self.wrapper
        if fsdp.gathers:
            fsdp.unshard(self, training, backward)  # STRATEGY: gather: all-gather the unit

    def after_layer(self):
        fsdp = self.wrapper
        if fsdp.gathers:
            fsdp.reshard(self)  # STRATEGY: free: nothing full is kept for backward, or for the next layer

    def grad_ready(self, param, grad):
        fsdp = self.wrapper
        for unit in fsdp.buckets.add(param, grad, send=fsdp.require_grad_sync):
            fsdp.reduce_scatter(unit)  # STRATEGY: now, async; backward goes on


LAYER_CLASSES = layer_classes(FSDPLayer)  # FSDPLinear, FSDPLayerNorm, FSDPEmbedding, ...
