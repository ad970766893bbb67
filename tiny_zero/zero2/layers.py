"""ZeRO-2 layers: each grad goes into its bucket's temporary buffer; a bucket
whose grads are final is reduce-scattered at once, asynchronously, during
backward, and its full grads are freed when that finishes (wrapper.py).

Compare with ../zero1/layers.py: the send moves into backward, and full grads
no longer outlive their bucket."""
from ..step import layer_classes


class Zero2Layer:
    def grad_ready(self, param, grad):
        wrapper = self.wrapper
        for bucket in wrapper.buckets.add(param, grad, send=wrapper.require_grad_sync):
            wrapper.reduce_scatter(bucket)  # STRATEGY: now, async; backward goes on


LAYER_CLASSES = layer_classes(Zero2Layer)  # Zero2Linear, Zero2LayerNorm, Zero2Embedding, ...
