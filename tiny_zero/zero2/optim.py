"""Zero2AdamW: the same as Zero1AdamW; only where the grads come from differs."""
from ..strategy import StrategyAdamW
from .wrapper import Zero2


class Zero2AdamW(StrategyAdamW):
    wrapper = Zero2
