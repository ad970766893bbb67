"""Context parallelism: the sequence split across the ranks of a context group; attention by ring or Ulysses."""
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = ["ring_attention", "ulysses_attention"]
