"""FSDP layers: around each layer's math, in forward and again in backward,
its unit is all-gathered before (the next unit is already on the way) and
freed after: at the unit's first layer and after its last. A grad goes into
its unit's bucket; a bucket whose grads are final is reduce-scattered at
once, asynchronously (wrapper.py). At world 1 nothing is gathered or sent.

Compare with ../zero3/layers.py: the same moments; only the collectives
differ, and how a unit is laid out, in wrapper.py."""
from ..hooked import HookedLayer
from ..module import Conv1D, Embedding, LayerNorm, Linear, RMSNorm
from ..step import LayerMoments, StrategyLayer, layer_classes


class FSDPLayer:
    def before_layer(self, backward_follows, backward):
        wrapper = self.wrapper
        if wrapper.releases_params:
            wrapper.unshard(self, backward_follows, backward)  # STRATEGY: gather: all-gather the unit

    def after_layer(self):
        wrapper = self.wrapper
        if wrapper.releases_params:
            wrapper.reshard(self)  # STRATEGY: free the units the next layer does not use

    def grad_ready(self, param, grad):
        wrapper = self.wrapper
        for unit in wrapper.buckets.add(param, grad, send=wrapper.require_grad_sync):  # a unit's trainable part
            wrapper.send_bucket(unit)  # STRATEGY: now, async; backward goes on


# The layers this strategy swaps in (module/layers.py's math, this mixin's moments, step.py's around them),
# and the same moments for a module reached through hooks (hooked.py):
class FSDPLinear(StrategyLayer, FSDPLayer, LayerMoments, Linear): pass
class FSDPLayerNorm(StrategyLayer, FSDPLayer, LayerMoments, LayerNorm): pass
class FSDPRMSNorm(StrategyLayer, FSDPLayer, LayerMoments, RMSNorm): pass
class FSDPEmbedding(StrategyLayer, FSDPLayer, LayerMoments, Embedding): pass
class FSDPConv1D(StrategyLayer, FSDPLayer, LayerMoments, Conv1D): pass
class FSDPHooked(HookedLayer, FSDPLayer, LayerMoments): pass

LAYER_CLASSES = layer_classes(FSDPLinear, FSDPLayerNorm, FSDPRMSNorm, FSDPEmbedding, FSDPConv1D, FSDPHooked)
