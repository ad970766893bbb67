"""Zero3AdamW: each rank steps only the tensors it owns (one flat buffer). No
all-gather follows: the next forward broadcasts them from their owners."""
from ..optimizer import StrategyAdamW
from .wrapper import Zero3


class Zero3AdamW(StrategyAdamW):
    wrapper = Zero3
