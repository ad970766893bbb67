"""Zero2AdamW: the same as Zero1AdamW; only where the grads come from differs."""
from ..optim.strategy import StrategyAdamW


class Zero2AdamW(StrategyAdamW):
    pass
