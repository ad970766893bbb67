"""ZeRO-1: the optimizer state is sharded; grads are reduce-scattered after backward."""
from .wrapper import Zero1
from .optim import Zero1AdamW

__all__ = ["Zero1", "Zero1AdamW"]
