"""DDPAdamW: every rank steps every parameter with the same averaged grads,
so the replicas stay identical with no further communication."""
from ..optim.strategy import StrategyAdamW


class DDPAdamW(StrategyAdamW):
    pass
