"""Zero1AdamW: AdamW over this rank's chunks only (8 bytes of state per
parameter, divided by N); after the step, the wrapper all-gathers the updated
chunks (Zero1.sync_params)."""
from ..optimizer import StrategyAdamW
from .wrapper import Zero1


class Zero1AdamW(StrategyAdamW):
    wrapper = Zero1
