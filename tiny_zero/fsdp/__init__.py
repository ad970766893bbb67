"""FSDP (intra-tensor): every tensor is split 1/N; each layer is all-gathered around its use."""
from .wrapper import FSDP
from .optim import FSDPAdamW

__all__ = ["FSDP", "FSDPAdamW"]
