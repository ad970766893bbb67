"""FSDPAdamW: each rank steps its 1/N slice of every layer. No all-gather
follows: the next forward gathers the updated slices."""
from ..strategy import StrategyAdamW
from .wrapper import FSDP


class FSDPAdamW(StrategyAdamW):
    wrapper = FSDP
