from .model import DDP
from .optim import DDPAdamW

__all__ = ["DDP", "DDPAdamW"]
