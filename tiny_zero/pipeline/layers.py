"""Pipeline layers: around its math, a stage's layer does what DDP's does,
among the replicas of its stage. Each grad goes into its bucket, in the flat
buffer of the stage's grads. A stage runs the backward of every micro-batch,
and a grad is final only in the last one's: until then the grads add up in
place; in the last, a bucket is all-reduced among the replicas as soon as its
grads are final, while the backward goes on (wrapper.py: Pipeline.all_reduce).
Nothing is gathered: a stage holds all of its parameters. The activations
between stages are not the layers' business: the schedule sends them."""
from ..hooked import HookedLayer
from ..module import Conv1D, Embedding, LayerNorm, Linear, RMSNorm
from ..step import LayerMoments, StrategyLayer, layer_classes


class PipelineLayer:
    def grad_ready(self, param, grad):
        wrapper = self.wrapper
        for bucket in wrapper.buckets.add(param, grad, send=wrapper.syncs_this_backward):  # the last micro-batch's backward
            wrapper.all_reduce(bucket)  # STRATEGY: now, async; backward goes on


# The layers this strategy swaps in (module/layers.py's math, this mixin's moments, step.py's around them),
# and the same moments for a module reached through hooks (hooked.py):
class PipelineLinear(StrategyLayer, PipelineLayer, LayerMoments, Linear): pass
class PipelineLayerNorm(StrategyLayer, PipelineLayer, LayerMoments, LayerNorm): pass
class PipelineRMSNorm(StrategyLayer, PipelineLayer, LayerMoments, RMSNorm): pass
class PipelineEmbedding(StrategyLayer, PipelineLayer, LayerMoments, Embedding): pass
class PipelineConv1D(StrategyLayer, PipelineLayer, LayerMoments, Conv1D): pass
class PipelineHooked(HookedLayer, PipelineLayer, LayerMoments): pass

LAYER_CLASSES = layer_classes(PipelineLinear, PipelineLayerNorm, PipelineRMSNorm, PipelineEmbedding,
                              PipelineConv1D, PipelineHooked)
