"""tiny_zero: DDP, ZeRO-1/2/3, FSDP and ZeRO-Offload, with tensor and pipeline parallelism, in small, readable, tested Python."""
from . import checkpoint, module, optim
from .ddp import DDP, DDPAdamW
from .zero1 import Zero1, Zero1AdamW
from .zero2 import Zero2, Zero2AdamW
from .zero3 import Zero3, Zero3AdamW
from .fsdp import FSDP, FSDPAdamW
from .offload import ZeroOffload, ZeroOffloadAdamW
from . import zero  # DeepSpeed's deepspeed.zero.Init and GatheredParameters
from . import comm  # DeepSpeed's deepspeed.comm names are there too (get_rank, barrier, all_reduce, ...)
from .comm import init_distributed  # DeepSpeed's deepspeed.init_distributed
from .engine import add_config_arguments, initialize  # DeepSpeed's, over the wrappers above (engine.py)

__version__ = "0.1.0"

STRATEGIES = {
    "ddp": (DDP, DDPAdamW),
    "zero1": (Zero1, Zero1AdamW),
    "zero2": (Zero2, Zero2AdamW),
    "zero3": (Zero3, Zero3AdamW),
    "fsdp": (FSDP, FSDPAdamW),
    "offload": (ZeroOffload, ZeroOffloadAdamW),
}

