"""DDP layers: each grad goes into its bucket, in the flat buffer of all
grads; a bucket whose grads are final is all-reduced at once, asynchronously,
while backward goes on. Nothing is gathered: every rank holds every parameter."""
from ..hooked import HookedLayer
from ..module import Conv1D, Embedding, LayerNorm, Linear, RMSNorm
from ..step import LayerMoments, StrategyLayer, layer_classes, place_in_flat_grads


class DDPLayer:
    grad_place = place_in_flat_grads  # each grad computed in its place in flat_grads

    def grad_ready(self, param, grad):
        wrapper = self.wrapper
        for bucket in wrapper.buckets.add(param, grad, send=wrapper.require_grad_sync):  # into flat_grads
            wrapper.all_reduce(bucket)  # STRATEGY: now, async; backward goes on


# The layers this strategy swaps in (module/layers.py's math, this mixin's moments, step.py's around them),
# and the same moments for a module reached through hooks (hooked.py):
class DDPLinear(StrategyLayer, DDPLayer, LayerMoments, Linear): pass
class DDPLayerNorm(StrategyLayer, DDPLayer, LayerMoments, LayerNorm): pass
class DDPRMSNorm(StrategyLayer, DDPLayer, LayerMoments, RMSNorm): pass
class DDPEmbedding(StrategyLayer, DDPLayer, LayerMoments, Embedding): pass
class DDPConv1D(StrategyLayer, DDPLayer, LayerMoments, Conv1D): pass
class DDPHooked(HookedLayer, DDPLayer, LayerMoments): pass

LAYER_CLASSES = layer_classes(DDPLinear, DDPLayerNorm, DDPRMSNorm, DDPEmbedding, DDPConv1D, DDPHooked)
