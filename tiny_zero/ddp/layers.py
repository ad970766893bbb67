"""DDP layers: a gradient, once final, goes into its bucket; a full bucket is
all-reduced at once, asynchronously, while backward goes on.

Every rank holds all parameters and all gradients. Collective here:
all_reduce, one per bucket, launched from backward_callback.
"""
from ..module import layer_classes
from ..strategy import StrategyLayer


class DDPLayer(StrategyLayer):
    def accumulate_grad(self, param, grad):
        ddp = self.wrapper
        ddp.grad_view(param).add_(grad)  # grads live in the bucket's flat buffer
        for bucket in ddp.queue.grad_added(param, send=ddp.require_grad_sync):
            bucket.handle = ddp.send_bucket(bucket, bucket.range(ddp.flat_grads))  # STRATEGY: now; wait before step


LAYER_CLASSES = layer_classes(DDPLayer)  # DDPLinear, DDPLayerNorm, DDPEmbedding
