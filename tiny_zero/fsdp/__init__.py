from .model import FSDP
from .optim import FSDPAdamW

__all__ = ["FSDP", "FSDPAdamW"]
