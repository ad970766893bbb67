"""ZeRO-2 layers: each gradient goes into its bucket's temporary buffer; a
complete bucket is reduce-scattered at once, asynchronously, during backward,
and its full grads are freed when that finishes (../buckets.py,
BucketedGrads).

Compare with ../zero1/module.py: the send moves into backward, and full
gradients no longer outlive their bucket.
"""
from ..module import layer_classes
from ..strategy import StrategyLayer


class Zero2Layer(StrategyLayer):
    def accumulate_grad(self, param, grad):
        self.wrapper.grads.add(param, grad)  # STRATEGY: a complete bucket is reduce-scattered now


LAYER_CLASSES = layer_classes(Zero2Layer)  # Zero2Linear, Zero2LayerNorm, Zero2Embedding
