"""DDP layers: each grad goes into its bucket, in the flat buffer of all
grads; a bucket whose grads are final is all-reduced at once, asynchronously,
while backward goes on. Nothing is gathered: every rank holds every parameter."""
from ..step import layer_classes


class DDPLayer:
    def grad_ready(self, param, grad):
        ddp = self.wrapper
        for bucket in ddp.buckets.add(param, grad, send=ddp.require_grad_sync):  # into flat_grads
            ddp.all_reduce(bucket)  # STRATEGY: now, async; backward goes on


LAYER_CLASSES = layer_classes(DDPLayer)  # DDPLinear, DDPLayerNorm, DDPEmbedding, ...
