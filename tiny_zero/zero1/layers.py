"""ZeRO-1 layers: backward sends nothing. Each grad is added into the full
flat grad buffer; the reduce-scatter comes after backward (wrapper.py).

Compare with ../ddp/layers.py: the all_reduce during backward is gone."""
from ..step import layer_classes


class Zero1Layer:
    def grad_ready(self, param, grad):
        wrapper = self.wrapper
        wrapper.buckets.add(param, grad, send=False)  # STRATEGY: full grads in flat_grads, no send yet


LAYER_CLASSES = layer_classes(Zero1Layer)  # Zero1Linear, Zero1LayerNorm, Zero1Embedding, ...
