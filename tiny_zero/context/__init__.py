"""Context parallelism: the sequence split across the ranks of a context group; attention by ring or Ulysses."""
from .optim import ContextParallelAdamW
from .ring import ring_attention
from .ulysses import ulysses_attention
from .wrapper import ContextParallel, data_parallel

__all__ = ["ContextParallel", "ContextParallelAdamW", "data_parallel", "ring_attention", "ulysses_attention"]
