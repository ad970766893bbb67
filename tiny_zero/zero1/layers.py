"""ZeRO-1 layers: backward sends nothing. Each gradient is added into the
full flat gradient buffer; the reduce-scatter comes after backward.

Compare with ../ddp/module.py: the all_reduce during backward is gone.
"""
from ..module import layer_classes
from ..strategy import StrategyLayer


class Zero1Layer(StrategyLayer):
    def accumulate_grad(self, param, grad):
        zero1 = self.wrapper
        zero1.bucket_of[param].view(zero1.flat_grads, param).add_(grad)  # STRATEGY: full grads, no send yet


LAYER_CLASSES = layer_classes(Zero1Layer)  # Zero1Linear, Zero1LayerNorm, Zero1Embedding
