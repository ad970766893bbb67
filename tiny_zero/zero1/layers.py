"""ZeRO-1 layers: backward sends nothing. Each grad is added into the full
flat grad buffer; the reduce-scatter comes after backward (wrapper.py).

Compare with ../ddp/layers.py: the all_reduce during backward is gone."""
from ..hooked import HookedLayer
from ..module import Conv1D, Embedding, LayerNorm, Linear, RMSNorm
from ..step import LayerMoments, StrategyLayer, layer_classes, place_in_flat_grads


class Zero1Layer:
    grad_place = place_in_flat_grads  # each grad computed in its place in flat_grads

    def grad_ready(self, param, grad):
        wrapper = self.wrapper
        wrapper.buckets.add(param, grad, send=False)  # STRATEGY: full grads in flat_grads, no send yet


# The layers this strategy swaps in (module/layers.py's math, this mixin's moments, step.py's around them),
# and the same moments for a module reached through hooks (hooked.py):
class Zero1Linear(StrategyLayer, Zero1Layer, LayerMoments, Linear): pass
class Zero1LayerNorm(StrategyLayer, Zero1Layer, LayerMoments, LayerNorm): pass
class Zero1RMSNorm(StrategyLayer, Zero1Layer, LayerMoments, RMSNorm): pass
class Zero1Embedding(StrategyLayer, Zero1Layer, LayerMoments, Embedding): pass
class Zero1Conv1D(StrategyLayer, Zero1Layer, LayerMoments, Conv1D): pass
class Zero1Hooked(HookedLayer, Zero1Layer, LayerMoments): pass

LAYER_CLASSES = layer_classes(Zero1Linear, Zero1LayerNorm, Zero1RMSNorm, Zero1Embedding, Zero1Conv1D,
                              Zero1Hooked)
