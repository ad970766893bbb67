"""AdamW for tiny_zero: a flat-tensor update (fused Triton kernel on GPU, plain torch elsewhere)
and a drop-in torch.optim.AdamW that uses it. Importing this package never imports triton."""

from .adamw import adamw_update_
from .drop_in import AdamW

__all__ = ["AdamW", "adamw_update_"]
