"""Zero3AdamW: each rank steps only the tensors it owns. No all-gather
follows: the next forward broadcasts them from their owners."""
from ..optim.strategy import StrategyAdamW


class Zero3AdamW(StrategyAdamW):
    pass
