"""Every collective that tiny_zero sends goes through these few functions.

They are thin: each calls torch.distributed and records what it moved in
`stats`, so tests and benchmarks can count a strategy's traffic per step.
`elements` is the size of the whole collective (the full buffer: what an
all-reduce reduces, what a reduce-scatter scatters, what an all-gather
gathers); each rank sends and receives about (N-1)/N of that.
"""
from collections import defaultdict

import torch.distributed as dist

# torch 2.13 renamed the single-tensor collectives; 2.11 has only the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommStats:
    def __init__(self):
        self.reset()

    def reset(self):
        self.calls = defaultdict(int)
        self.elements = defaultdict(int)
        self.bytes = defaultdict(int)

    def record(self, kind, tensor):
        self.calls[kind] += 1
        self.elements[kind] += tensor.numel()
        self.bytes[kind] += tensor.numel() * tensor.element_size()

    def total_elements(self):
        return sum(self.elements.values())


stats = CommStats()


def all_reduce(tensor, async_op=False):
    stats.record("all_reduce", tensor)
    return dist.all_reduce(tensor, async_op=async_op)


def reduce_scatter(out, full, async_op=False):
    """Sum `full` over ranks; this rank keeps chunk `rank` of it in `out`."""
    stats.record("reduce_scatter", full)
    return _reduce_scatter(out, full, async_op=async_op)


def all_gather(full, chunk, async_op=False):
    """Concatenate every rank's `chunk` into `full` (chunk may be a view of full)."""
    stats.record("all_gather", full)
    return _all_gather(full, chunk, async_op=async_op)


def broadcast(tensor, src, async_op=False):
    stats.record("broadcast", tensor)
    return dist.broadcast(tensor, src, async_op=async_op)


def reduce(tensor, dst, async_op=False):
    """Sum `tensor` over ranks into rank `dst`."""
    stats.record("reduce", tensor)
    return dist.reduce(tensor, dst, async_op=async_op)


def all_gather_object(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
