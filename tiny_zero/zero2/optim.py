"""Zero2AdamW: AdamW over this rank's chunks, as Zero1AdamW; only where the
averaged grads come from differs. After the step, the wrapper all-gathers the
updated chunks (Zero2.sync_params)."""
from ..optimizer import StrategyAdamW
from .wrapper import Zero2


class Zero2AdamW(StrategyAdamW):
    wrapper = Zero2
