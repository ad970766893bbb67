"""FSDPAdamW: each rank steps its 1/N slice of every tensor (one flat buffer).
No all-gather follows: the next forward gathers the updated slices.
FSDPOffloadAdamW: the same, on the host, as ../offload's step."""
from ..offload.optim import ZeroOffloadAdamW
from ..optimizer import StrategyAdamW
from .wrapper import FSDP, FSDPOffload


class FSDPAdamW(StrategyAdamW):
    wrapper = FSDP


class FSDPOffloadAdamW(ZeroOffloadAdamW):
    wrapper = FSDPOffload
