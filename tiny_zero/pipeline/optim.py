"""PipelineAdamW: each rank steps its stage's parameters (one flat buffer),
with grads averaged over the stage's replicas, as DDPAdamW does over the
world; a tied parameter only on the stage that owns it, which then sends the
new value to the other stages that hold it (Pipeline.sync_params)."""
from ..optimizer import StrategyAdamW
from .wrapper import Pipeline


class PipelineAdamW(StrategyAdamW):
    wrapper = Pipeline
