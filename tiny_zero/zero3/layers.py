"""ZeRO-3 layers: the strategy's "when", in time order. Before a layer
computes, in forward and again in backward: the units it needs are gathered
(broadcast from their owners), the next unit's gather is started (prefetch),
and it waits for them. After it: every unit the next layer does not use is
freed, but what this rank owns. As a grad is ready it goes into its owner's
bucket; a bucket whose grads are final is reduced to its owner at once,
asynchronously (wrapper.py). The means (the order, the buffers) are in
../units.py."""
from ..hooked import HookedLayer
from ..module import Conv1D, Embedding, LayerNorm, Linear, RMSNorm
from ..step import LayerMoments, StrategyLayer, layer_classes


class Zero3Layer:
    def before_layer(self, backward_follows, backward):
        wrapper = self.wrapper
        if wrapper.releases_params:
            units = wrapper.units_to_gather(self, backward_follows, backward)  # those it needs, not gathered (units.py)
            wrapper.gather(units)  # STRATEGY: gather before use: broadcast from the owners (start_gather)
            wrapper.prefetch(wrapper.order.next_unit(wrapper.gathered) if units else None)  # STRATEGY: the next unit's
            wrapper.wait_for(units)  # STRATEGY: the parameters show the gathered values

    def after_layer(self):
        wrapper = self.wrapper
        if wrapper.releases_params:
            for unit in wrapper.unused_next():
                wrapper.free(unit)  # STRATEGY: free after use: the next layer does not use it

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
