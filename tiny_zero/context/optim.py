"""ContextParallelAdamW: ddp's AdamW. Every rank holds every parameter and the
same grads (averaged over the context group and the replicas), so every rank
makes the same update and nothing is sent after the step."""
from ..optimizer import StrategyAdamW
from .wrapper import ContextParallel


class ContextParallelAdamW(StrategyAdamW):
    wrapper = ContextParallel
