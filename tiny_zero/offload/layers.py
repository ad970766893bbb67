"""ZeRO-Offload layers: as ZeRO-2's. Each grad goes into its bucket's
temporary buffer; a bucket whose grads are final is reduce-scattered at once,
asynchronously, during backward; when that finishes, this rank's slice of the
sum is copied to the host and the bucket's full grads are freed (wrapper.py).

Compare with ../zero2/layers.py: the same; what moves to the host is in wrapper.py."""
from ..hooked import HookedLayer
from ..module import Conv1D, Embedding, LayerNorm, Linear, RMSNorm
from ..step import LayerMoments, StrategyLayer, layer_classes


class ZeroOffloadLayer:
    def grad_ready(self, param, grad):
        wrapper = self.wrapper
        for bucket in wrapper.buckets.add(param, grad, send=wrapper.require_grad_sync):
            wrapper.send_bucket(bucket)  # STRATEGY: now, async; backward goes on


# The layers this strategy swaps in (module/layers.py's math, this mixin's moments, step.py's around them),
# and the same moments for a module reached through hooks (hooked.py):
class ZeroOffloadLinear(StrategyLayer, ZeroOffloadLayer, LayerMoments, Linear): pass
class ZeroOffloadLayerNorm(StrategyLayer, ZeroOffloadLayer, LayerMoments, LayerNorm): pass
class ZeroOffloadRMSNorm(StrategyLayer, ZeroOffloadLayer, LayerMoments, RMSNorm): pass
class ZeroOffloadEmbedding(StrategyLayer, ZeroOffloadLayer, LayerMoments, Embedding): pass
class ZeroOffloadConv1D(StrategyLayer, ZeroOffloadLayer, LayerMoments, Conv1D): pass
class ZeroOffloadHooked(HookedLayer, ZeroOffloadLayer, LayerMoments): pass

LAYER_CLASSES = layer_classes(ZeroOffloadLinear, ZeroOffloadLayerNorm, ZeroOffloadRMSNorm,
                              ZeroOffloadEmbedding, ZeroOffloadConv1D, ZeroOffloadHooked)
