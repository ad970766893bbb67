"""Every collective that tiny_zero sends goes through these few functions.

They are thin: each calls torch.distributed and records what it moved in
`stats`, so tests and benchmarks can count a strategy's traffic per step.
`elements` is the size of the whole collective (the full buffer: what an
all-reduce reduces, what a reduce-scatter scatters, what an all-gather
gathers); each rank sends and receives about (N-1)/N of that.

Each returns a Pending, whose wait() gives up after `timeout` (default 10
minutes; set_timeout changes it) with an error that names the collective and
where it was started (`where`, which the layers keep up to date: "blocks.3.
attn.c_proj backward"). A rank that skipped a forward or backward the others
ran cannot be detected in advance; this turns the hang into that error.
On CUDA the wait stays asynchronous (the GPU stream waits, not the CPU), so
there the process group's own timeout applies, without the layer's name.
"""
from collections import defaultdict
from datetime import timedelta

import torch.distributed as dist

timeout = timedelta(minutes=10)
where = "setup"  # what the strategy is doing now


def set_timeout(seconds):
    global timeout
    timeout = timedelta(seconds=seconds)


class CollectiveError(RuntimeError):
    pass


class Pending:
    """A collective in flight."""

    def __init__(self, work, kind, tensor):
        self.work, self.kind, self.where = work, kind, where
        self.numel, self.on_cuda = tensor.numel(), tensor.is_cuda

    def wait(self):
        try:
            if self.on_cuda:
                self.work.wait()
            else:
                self.work.wait(timeout)
        except RuntimeError as e:
            raise CollectiveError(
                f"{self.kind} of {self.numel} elements, started in {self.where} and waited for in "
                f"{where}, failed or timed out after {timeout}: a rank may have skipped a forward or "
                f"backward that the others ran, or died ({e})") from e


def _run(kind, tensor, launch, async_op):
    stats.record(kind, tensor)
    pending = Pending(launch(), kind, tensor)
    if async_op:
        return pending
    pending.wait()

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


stats = CommStats()


def all_reduce(tensor, async_op=False):
    return _run("all_reduce", tensor, lambda: dist.all_reduce(tensor, async_op=True), async_op)


def reduce_scatter(out, full, async_op=False):
    """Sum `full` over ranks; this rank keeps chunk `rank` of it in `out`."""
    return _run("reduce_scatter", full, lambda: _reduce_scatter(out, full, async_op=True), async_op)


def all_gather(full, chunk, async_op=False):
    """Concatenate every rank's `chunk` into `full` (chunk may be a view of full)."""
    return _run("all_gather", full, lambda: _all_gather(full, chunk, async_op=True), async_op)


def broadcast(tensor, src, async_op=False):
    return _run("broadcast", tensor, lambda: dist.broadcast(tensor, src, async_op=True), async_op)


def reduce(tensor, dst, async_op=False):
    """Sum `tensor` over ranks into rank `dst`."""
    return _run("reduce", tensor, lambda: dist.reduce(tensor, dst, async_op=True), async_op)


def all_gather_object(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
