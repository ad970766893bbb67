"""DDP: every rank holds everything; grads are all-reduced in buckets during backward."""
from .wrapper import DDP
from .optim import DDPAdamW

__all__ = ["DDP", "DDPAdamW"]
