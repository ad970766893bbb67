"""ZeRO-Offload layers: as ZeRO-2's. Each grad goes into its bucket's
temporary buffer; a bucket whose grads are final is reduce-scattered at once,
asynchronously, during backward; when that finishes, this rank's slice of the
sum is copied to the host and the bucket's full grads are freed (wrapper.py).

Compare with ../zero2/layers.py: the same; what moves to the host is in wrapper.py."""
from ..step import layer_classes


class ZeroOffloadLayer:
    def grad_ready(self, param, grad):
        wrapper = self.wrapper
        for bucket in wrapper.buckets.add(param, grad, send=wrapper.require_grad_sync):
            wrapper.reduce_scatter(bucket)  # STRATEGY: now, async; backward goes on


LAYER_CLASSES = layer_classes(ZeroOffloadLayer)  # ZeroOffloadLinear, ZeroOffloadLayerNorm, ZeroOffloadEmbedding, ...
