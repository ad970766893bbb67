"""ZeRO-3 layers: around each layer's math, in forward and again in backward,
its unit is broadcast from the owners before (the next unit is already on
the way) and freed after, but what this rank owns: at the unit's first layer
and after its last. A grad goes into its owner's bucket; a bucket whose grads
are final is reduced to its owner at once, asynchronously (wrapper.py)."""
from ..hooked import HookedLayer
from ..module import Conv1D, Embedding, LayerNorm, Linear, RMSNorm
from ..step import LayerMoments, StrategyLayer, layer_classes


class Zero3Layer:
    def before_layer(self, backward_follows, backward):
        wrapper = self.wrapper
        if wrapper.releases_params:
            wrapper.unshard(self, backward_follows, backward)  # STRATEGY: gather: broadcast from the owners

    def after_layer(self):
        wrapper = self.wrapper
        if wrapper.releases_params:
            wrapper.reshard(self)  # STRATEGY: free the units the next layer does not use

    def grad_ready(self, param, grad):
        wrapper = self.wrapper
        for bucket in wrapper.buckets.add(param, grad, send=wrapper.require_grad_sync):
            wrapper.send_bucket(bucket)  # STRATEGY: to its owner, now, async; backward goes on


# The layers this strategy swaps in (module/layers.py's math, this mixin's moments, step.py's around them),
# and the same moments for a module reached through hooks (hooked.py):
class Zero3Linear(StrategyLayer, Zero3Layer, LayerMoments, Linear): pass
class Zero3LayerNorm(StrategyLayer, Zero3Layer, LayerMoments, LayerNorm): pass
class Zero3RMSNorm(StrategyLayer, Zero3Layer, LayerMoments, RMSNorm): pass
class Zero3Embedding(StrategyLayer, Zero3Layer, LayerMoments, Embedding): pass
class Zero3Conv1D(StrategyLayer, Zero3Layer, LayerMoments, Conv1D): pass
class Zero3Hooked(HookedLayer, Zero3Layer, LayerMoments): pass

LAYER_CLASSES = layer_classes(Zero3Linear, Zero3LayerNorm, Zero3RMSNorm, Zero3Embedding, Zero3Conv1D,
                              Zero3Hooked)
