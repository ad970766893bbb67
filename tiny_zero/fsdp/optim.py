"""FSDPAdamW: each rank steps its 1/N slice of every tensor (one flat buffer).
No all-gather follows: the next forward gathers the updated slices."""
from ..optimizer import StrategyAdamW
from .wrapper import FSDP


class FSDPAdamW(StrategyAdamW):
    wrapper = FSDP
