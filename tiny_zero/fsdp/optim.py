"""FSDPAdamW: each rank steps its 1/N slice of every layer. No all-gather
follows: the next forward gathers the updated slices."""
from ..optim.strategy import StrategyAdamW
from .model import FSDP


class FSDPAdamW(StrategyAdamW):
    wrapper = FSDP
