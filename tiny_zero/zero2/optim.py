"""Zero2AdamW: the same as Zero1AdamW; only where the grads come from differs."""
from ..optim.strategy import StrategyAdamW
from .model import Zero2


class Zero2AdamW(StrategyAdamW):
    wrapper = Zero2
