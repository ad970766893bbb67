"""ZeRO-Offload: ZeRO-2's sharding, with the optimizer (fp32 masters, AdamW state, the step) in host memory."""
from .wrapper import ZeroOffload
from .optim import ZeroOffloadAdamW

__all__ = ["ZeroOffload", "ZeroOffloadAdamW"]
