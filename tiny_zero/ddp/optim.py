"""DDPAdamW: every rank steps every parameter (one flat buffer) with the same
averaged grads, so the replicas stay identical with no further communication."""
from ..optimizer import StrategyAdamW
from .wrapper import DDP


class DDPAdamW(StrategyAdamW):
    wrapper = DDP
