"""ZeRO-2 layers: each grad goes into its bucket's temporary buffer; a bucket
whose grads are final is reduce-scattered at once, asynchronously, during
backward, and its full grads are freed when that finishes (wrapper.py).

Compare with ../zero1/layers.py: the send moves into backward, and full grads
no longer outlive their bucket."""
from ..hooked import HookedLayer
from ..module import Conv1D, Embedding, LayerNorm, Linear, RMSNorm
from ..step import LayerMoments, StrategyLayer, layer_classes


class Zero2Layer:
    def grad_ready(self, param, grad):
        wrapper = self.wrapper
        for bucket in wrapper.buckets.add(param, grad, send=wrapper.require_grad_sync):
            wrapper.send_bucket(bucket)  # STRATEGY: now, async; backward goes on


# The layers this strategy swaps in (module/layers.py's math, this mixin's moments, step.py's around them),
# and the same moments for a module reached through hooks (hooked.py):
class Zero2Linear(StrategyLayer, Zero2Layer, LayerMoments, Linear): pass
class Zero2LayerNorm(StrategyLayer, Zero2Layer, LayerMoments, LayerNorm): pass
class Zero2RMSNorm(StrategyLayer, Zero2Layer, LayerMoments, RMSNorm): pass
class Zero2Embedding(StrategyLayer, Zero2Layer, LayerMoments, Embedding): pass
class Zero2Conv1D(StrategyLayer, Zero2Layer, LayerMoments, Conv1D): pass
class Zero2Hooked(HookedLayer, Zero2Layer, LayerMoments): pass

LAYER_CLASSES = layer_classes(Zero2Linear, Zero2LayerNorm, Zero2RMSNorm, Zero2Embedding, Zero2Conv1D,
                              Zero2Hooked)
