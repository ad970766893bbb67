"""Communication: every collective tiny_zero sends, counted. It makes no
strategy decision: what to send, where, and when to wait and free is in the
strategy folders (and units.py, for zero3's and fsdp's gathers).

Collectives: all_reduce, reduce_scatter, all_gather, broadcast, reduce; and
    point to point, send, recv and exchange (several at once); all_to_all.
    Thin calls of torch.distributed that record what they move in `stats`
    (calls, elements and bytes per kind: the whole buffer of the collective;
    each rank sends and receives about (N-1)/N of it). Each returns a Pending
    whose wait() gives up after `timeout` (10 minutes; set_timeout) with an
    error that names the collective and where it started (`where`, which the
    layers keep up to date: "blocks.3.attn.c_proj backward"). On CUDA the wait
    stays asynchronous (the stream waits, not the CPU): there the process
    group's own timeout applies.
DeepSpeed's deepspeed.comm names, for its scripts (import tiny_zero as deepspeed;
    deepspeed.comm.get_rank()): init_distributed, get_rank, get_world_size,
    get_local_rank, barrier, all_reduce (op=ReduceOp.SUM first, as DeepSpeed's).
Before each collective, the ranks' agreements still in flight are checked
    (agreements.py): a rank about to run another collective than the others
    is told so, on every rank, rather than left to hang.
"""
import os
import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

timeout = timedelta(minutes=10)
where = "setup"  # what the strategy is doing now
recorder = None  # while tiny_zero.measure.trace records a step: told of each collective and each wait
failed = None  # the error of the first collective that failed: the run ends at exit without waiting (agreements.py)


def set_timeout(seconds):
    global timeout
    timeout = timedelta(seconds=seconds)


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a rank skipped what the others ran, or died."""


class DisagreementError(RuntimeError):
    """The ranks were about to run different collectives: raised on every rank alike."""


# ---------------------------------------------------------------- collectives

class Pending:
    """A collective in flight."""

    def __init__(self, work, kind, tensor):
        self.work, self.kind, self.where = work, kind, where
        self.numel, self.on_cuda = tensor.numel(), tensor.is_cuda
        self.span = None  # its span in the recorder's trace, while one records

    def wait(self):
        started = recorder.stamp() if recorder is not None else None
        waiting_since = time.monotonic()
        try:
            if self.on_cuda:
                self.work.wait()
            else:
                self.work.wait(timeout)
        except RuntimeError as e:
            waited = time.monotonic() - waiting_since
            # a peer that died fails the wait at once; a rank that never comes, at the timeout
            timed_out = waited >= 0.99 * timeout.total_seconds()
            how = f"timed out after {timeout}" if timed_out else f"failed after {waited:.1f} s of waiting"
            global failed
            failed = failed or f"{self.kind} in {self.where}, {how}"
            raise CollectiveError(
                f"{self.kind} of {self.numel} elements, started in {self.where} and waited for in "
                f"{where}, {how}: a rank may have skipped a forward or "
                f"backward that the others ran, or died ({e})") from e
        if recorder is not None:
            recorder.waited(self, started)


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


class _Done:
    """The work of a collective over one rank: done when it is made."""

    def wait(self, timeout=None):
        return True


def _run(kind, tensor, launch, async_op, group=None, alone=None):
    """Record and launch a collective. Over a group of one rank there is
    nothing to exchange: `alone()` does the local part of it (a copy, or
    nothing), and no call goes to the backend."""
    agreements.check_agreements()  # any collective: the ranks agreed first on what they are about to run
    stats.record(kind, tensor)
    launched = recorder.stamp() if recorder is not None else None
    if alone is not None and dist.get_world_size(group) == 1:
        alone()
        work = _Done()
    else:
        work = launch()
    pending = Pending(work, kind, tensor)
    if recorder is not None:
        recorder.collective(pending, tensor, launched)
    if async_op:
        return pending
    pending.wait()


def _nothing():
    pass


def _copy(dest, source):
    """dest = source, unless they are one and the same memory."""
    return lambda: None if dest.data_ptr() == source.data_ptr() else dest.copy_(source)


# torch 2.13 renamed the single-tensor collectives; 2.11 has only the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


ReduceOp = dist.ReduceOp


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    return _run("all_reduce", tensor, lambda: dist.all_reduce(tensor, op, group=group, async_op=True), async_op,
                group, _nothing)


def reduce_scatter(out, full, async_op=False, group=None):
    """Sum `full` over ranks; this rank keeps chunk `rank` of it in `out`."""
    return _run("reduce_scatter", full, lambda: _reduce_scatter(out, full, group=group, async_op=True), async_op,
                group, _copy(out, full))


def all_gather(full, chunk, async_op=False, group=None):
    """Concatenate every rank's `chunk` into `full` (chunk may be a view of full)."""
    return _run("all_gather", full, lambda: _all_gather(full, chunk, group=group, async_op=True), async_op,
                group, _copy(full, chunk))


def broadcast(tensor, src, async_op=False, group=None):
    return _run("broadcast", tensor, lambda: dist.broadcast(tensor, src, group=group, async_op=True), async_op,
                group, _nothing)


def reduce(tensor, dst, async_op=False, group=None):
    """Sum `tensor` over ranks into rank `dst` (in place there)."""
    return _run("reduce", tensor, lambda: dist.reduce(tensor, dst, group=group, async_op=True), async_op,
                group, _nothing)


def all_to_all(out, chunks, async_op=False, group=None, out_sizes=None, in_sizes=None):
    """Chunk i of `chunks` (split along dim 0) to rank i of the group; `out`
    gets rank i's chunk for this rank at chunk i. Equal chunks, or in_sizes[i]
    rows to rank i and out_sizes[i] rows from it (uneven: expert parallelism)."""
    return _run("all_to_all", chunks, lambda: dist.all_to_all_single(out, chunks, out_sizes, in_sizes, group=group,
                                                                     async_op=True),
                async_op, group, _copy(out, chunks))


def send(tensor, dst, async_op=False, group=None):
    """Point to point: `tensor` to global rank `dst` (until it is sent, leave it as it is)."""
    return _run("send", tensor, lambda: dist.isend(tensor, dst, group=group), async_op)


def recv(tensor, src, async_op=False, group=None):
    """Point to point: into `tensor`, from global rank `src`."""
    return _run("recv", tensor, lambda: dist.irecv(tensor, src, group=group), async_op)


def exchange(sends=(), recvs=(), group=None):
    """Post sends [(tensor, dst)] and receives [(tensor, src)] at once. NCCL
    runs the point-to-point calls between two ranks in order, on one stream:
    two ranks that each send to the other before receiving would wait for each
    other forever. Posted together (one NCCL group, as torch's
    batch_isend_irecv makes it), they pass. Returns (pending sends, pending
    receives): wait on a receive before reading its tensor, on a send before
    changing its tensor. Where the backend groups them (NCCL), one Pending
    covers them all, among the receives."""
    ops = [("send", dist.isend, t, peer) for t, peer in sends] + [("recv", dist.irecv, t, peer) for t, peer in recvs]
    if not ops:
        return [], []
    for kind, _, tensor, _ in ops:
        stats.record(kind, tensor)
    works = dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group) for _, op, tensor, peer in ops])
    pending = [Pending(work, kind, tensor) for work, (kind, _, tensor, _) in zip(works, ops)]
    if len(works) < len(ops):  # grouped: one work for all of them
        return [], pending
    return pending[:len(sends)], pending[len(sends):]


def barrier(group=None):
    """Wait until every rank is here. Unlike the collectives above, it does
    not settle the agreements in flight first: it meets torch's own
    dist.barrier() on a rank that is not at them (state_dicts.py:
    meet_for_state_dict)."""
    flag = torch.zeros(1)
    Pending(dist.barrier(group=group, async_op=True), "barrier", flag).wait()


def all_gather_object(obj):
    """Every rank's `obj`, after the agreements in flight are settled (as
    before any collective: a disagreement is told first)."""
    agreements.check_agreements()
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------- DeepSpeed's deepspeed.comm names

def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500, verbose=True,
                     timeout=None, init_method=None, dist_init_required=None, config=None, rank=-1, world_size=-1):
    """DeepSpeed's: the default process group, made if there is none. With no backend, address or rank
    given, as every tiny_zero wrapper makes it (torchrun's environment, else a world of one; nccl on
    CUDA, else gloo). MPI discovery has no effect: start the ranks with torchrun."""
    if dist.is_initialized() or dist_init_required is False:
        return
    given = {"init_method": init_method, "timeout": timeout, "rank": rank, "world_size": world_size}
    given = {k: v for k, v in given.items() if v not in (None, -1)}
    if dist_backend is None and not given:
        distributed.init_distributed()
    else:
        dist.init_process_group(dist_backend or ("nccl" if distributed.uses_cuda() else "gloo"), **given)


def get_rank(group=None):
    return dist.get_rank(group)


def get_world_size(group=None):
    return dist.get_world_size(group)


def get_local_rank():
    return int(os.environ.get("LOCAL_RANK", 0))


from . import agreements, distributed  # noqa: E402  (last: agreements.py takes Pending from here)
