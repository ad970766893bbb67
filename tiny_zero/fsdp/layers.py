"""FSDP layers: the strategy's "when", in time order, as ../zero3/layers.py's:
only the collectives differ, and a unit's layout (wrapper.py). Before a layer
computes, forward and backward: its units all-gathered, the next unit's
gather started, a wait for them; after it, the units the next layer does not
use freed. A bucket (a unit's grads) whose grads are final is
reduce-scattered at once, asynchronously. World 1: nothing is gathered or sent."""
from ..hooked import HookedLayer
from ..module import Conv1D, Embedding, LayerNorm, Linear, RMSNorm
from ..step import LayerMoments, StrategyLayer, layer_classes


class FSDPLayer:
    def before_layer(self, backward_follows, backward):
        wrapper = self.wrapper
        if wrapper.releases_params:
            units = wrapper.units_to_gather(self, backward_follows, backward)  # those it needs, not gathered (units.py)
            wrapper.gather(units)  # STRATEGY: gather before use: all-gather the slices (start_gather)
            wrapper.prefetch(wrapper.order.next_unit(wrapper.gathered) if units else None)  # STRATEGY: the next unit's
            wrapper.wait_for(units)  # STRATEGY: the parameters show the gathered values

    def after_layer(self):
        wrapper = self.wrapper
        if wrapper.releases_params:
            for unit in wrapper.unused_next():
                wrapper.free(unit)  # STRATEGY: free after use: the next layer does not use it

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
