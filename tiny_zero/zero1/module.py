"""ZeRO-1 layers: backward sends nothing. Each gradient is added into the
full flat gradient buffer; the reduce-scatter comes after backward.

Compare with ../ddp/module.py: the all_reduce during backward is gone.
"""
import torch.nn as nn

from ..module import Embedding, LayerNorm, Linear
from ..wrapper import StrategyLayer


class Zero1Layer(StrategyLayer):
    def accumulate_grad(self, param, grad):
        zero1 = self.wrapper
        zero1.bucket_of[param].view(zero1.flat_grads, param).add_(grad)  # STRATEGY: full grads, no send yet


class Zero1Linear(Zero1Layer, Linear):
    pass


class Zero1LayerNorm(Zero1Layer, LayerNorm):
    pass


class Zero1Embedding(Zero1Layer, Embedding):
    pass


LAYER_CLASSES = {nn.Linear: Zero1Linear, nn.LayerNorm: Zero1LayerNorm, nn.Embedding: Zero1Embedding}
