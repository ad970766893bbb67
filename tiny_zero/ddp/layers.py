"""DDP layers: each grad goes into its bucket, in the flat buffer of all
grads; a bucket whose grads are final is all-reduced at once, asynchronously,
while backward goes on. Nothing is gathered: every rank holds every parameter."""
from ..step import layer_classes, place_in_flat_grads


class DDPLayer:
    grad_place = place_in_flat_grads  # each grad computed in its place in flat_grads

    def grad_ready(self, param, grad):
        wrapper = self.wrapper
        for bucket in wrapper.buckets.add(param, grad, send=wrapper.require_grad_sync):  # into flat_grads
            wrapper.all_reduce(bucket)  # STRATEGY: now, async; backward goes on


LAYER_CLASSES = layer_classes(DDPLayer)  # DDPLinear, DDPLayerNorm, DDPEmbedding, ...
