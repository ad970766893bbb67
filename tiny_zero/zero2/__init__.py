"""ZeRO-2: optimizer state and grads are sharded; grads are reduce-scattered during backward."""
from .wrapper import Zero2
from .optim import Zero2AdamW

__all__ = ["Zero2", "Zero2AdamW"]
