from .model import Zero3
from .optim import Zero3AdamW

__all__ = ["Zero3", "Zero3AdamW"]
