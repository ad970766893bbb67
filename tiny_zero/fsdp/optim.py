"""FSDPAdamW: each rank steps its 1/N slice of every layer. No all-gather
follows: the next forward gathers the updated slices."""
from ..optim.strategy import StrategyAdamW


class FSDPAdamW(StrategyAdamW):
    pass
