"""DDPAdamW: every rank steps every parameter with the same averaged grads,
so the replicas stay identical with no further communication."""
from ..strategy import StrategyAdamW
from .wrapper import DDP


class DDPAdamW(StrategyAdamW):
    wrapper = DDP
