"""ZeRO-3 (inter-tensor): each whole tensor is owned by one rank and broadcast around its use."""
from .wrapper import Zero3
from .optim import Zero3AdamW

__all__ = ["Zero3", "Zero3AdamW"]
