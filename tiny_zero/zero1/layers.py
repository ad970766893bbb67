"""ZeRO-1 layers: backward sends nothing. Each grad is added into the full
flat grad buffer; the reduce-scatter comes after backward (wrapper.py).

Compare with ../ddp/layers.py: the all_reduce during backward is gone."""
from ..step import layer_classes, place_in_flat_grads


class Zero1Layer:
    grad_place = place_in_flat_grads  # each grad computed in its place in flat_grads

    def grad_ready(self, param, grad):
        wrapper = self.wrapper
        wrapper.buckets.add(param, grad, send=False)  # STRATEGY: full grads in flat_grads, no send yet


LAYER_CLASSES = layer_classes(Zero1Layer)  # Zero1Linear, Zero1LayerNorm, Zero1Embedding, ...
