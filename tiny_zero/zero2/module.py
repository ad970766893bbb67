"""ZeRO-2 layers: each gradient goes into its bucket's temporary buffer; a
complete bucket is reduce-scattered at once, asynchronously, during backward,
and its full grads are freed when that finishes (../buckets.py,
BucketedGrads).

Compare with ../zero1/module.py: the send moves into backward, and full
gradients no longer outlive their bucket.
"""
import torch.nn as nn

from ..module import Embedding, LayerNorm, Linear
from ..wrapper import StrategyLayer


class Zero2Layer(StrategyLayer):
    def accumulate_grad(self, param, grad):
        self.wrapper.grads.add(param, grad)  # STRATEGY: a complete bucket is reduce-scattered now


class Zero2Linear(Zero2Layer, Linear):
    pass


class Zero2LayerNorm(Zero2Layer, LayerNorm):
    pass


class Zero2Embedding(Zero2Layer, Embedding):
    pass


LAYER_CLASSES = {nn.Linear: Zero2Linear, nn.LayerNorm: Zero2LayerNorm, nn.Embedding: Zero2Embedding}
