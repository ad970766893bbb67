"""Communication: every collective tiny_zero sends, counted, and the
agreements that check, before they run, that every rank sends the same. They
make no strategy decision: what to send, where, and when to wait and free is
in the strategy folders.

Collectives: all_reduce, reduce_scatter, all_gather, broadcast, reduce; and
    point to point, send, recv and exchange (several at once).
    Thin calls of torch.distributed that record what they move in `stats`
    (calls, elements and bytes per kind: the whole buffer of the collective;
    each rank sends and receives about (N-1)/N of it). Each returns a Pending
    whose wait() gives up after `timeout` (10 minutes; set_timeout) with an
    error that names the collective and where it started (`where`, which the
    layers keep up to date: "blocks.3.attn.c_proj backward"). On CUDA the wait
    stays asynchronous (the stream waits, not the CPU): there the process
    group's own timeout applies.
agree(what, **values): every rank checks that every rank passed the same
    integers, on a side channel (a gloo group of its own, CPU tensors), before
    the collectives that would otherwise mismatch or hang; the same clear error
    on every rank if not. new_group(ranks) makes a process group with a side
    channel of its own, for agree(group=...) among those ranks only.
At exit (_settle_at_exit): the checks still in flight are waited for (a
    disagreement is told), then the process groups are destroyed, while the
    interpreter is whole: see there why a run would otherwise abort now and
    then on its way out.
"""
import atexit
import sys
import time
import weakref
import zlib
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

timeout = timedelta(minutes=10)
where = "setup"  # what the strategy is doing now
recorder = None  # while tiny_zero.measure.trace records a step: told of each collective and each wait


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
    check_agreements()  # any collective: the ranks agreed first on what they are about to run
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


def all_reduce(tensor, async_op=False, group=None):
    return _run("all_reduce", tensor, lambda: dist.all_reduce(tensor, group=group, async_op=True), async_op,
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


def all_gather_object(obj):
    """Every rank's `obj`, after the agreements in flight are settled (as
    before any collective: a disagreement is told first)."""
    check_agreements()
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------- agreement

# process group -> its side group; weak, so that both go when torch lets go of
# the group (dist.destroy_process_group): held here they would outlive it into
# the interpreter's teardown, where gloo can abort the process
_side_groups = weakref.WeakKeyDictionary()


def open_side_channel():
    """Create the side group agree() uses. Collective: every rank calls it at
    the same point (the wrappers do, at wrap time)."""
    world = dist.group.WORLD
    if world not in _side_groups and _has_peers():
        _side_groups[world] = dist.new_group(backend="gloo")


def new_group(ranks):
    """A process group of global `ranks`, with its own side channel for
    agree(group=...). Collective over the world: every rank calls it for every
    group, in the same order. A rank outside `ranks` gets None."""
    ranks = list(ranks)
    group = dist.new_group(ranks)
    side = dist.new_group(ranks, backend="gloo") if len(ranks) > 1 and _has_peers() else None
    if dist.get_rank() not in ranks:
        return None
    _side_groups[group] = side
    return group


def _has_peers():
    """More than one rank, and real ones (torch's fake process group, which
    simulates a large world in one process, has none to agree with)."""
    return dist.get_world_size() > 1 and dist.get_backend() != "fake"


def agree(what, group=None, wait=True, defer=False, **values):
    """Check that every rank (of `group`, one from new_group; default: the
    world) passed the same integers (one small all-reduce on the side group);
    raise DisagreementError, the same on every rank, if not. wait=False: the
    check is sent now and settled before this rank's next collective (or its
    next agree that waits), so its all-reduce runs while the rank computes.
    defer=True: not sent on its own; its values go out with this rank's next
    agree on the same group, or before its next collective if that comes
    first: one all-reduce for two checks. A value given as Spread(n) may
    differ: with wait=True agree returns {its name: (lowest, highest)}."""
    spread = {name: (v, v) for name, v in values.items() if isinstance(v, Spread)}
    if not _has_peers() or (group is not None and dist.get_world_size(group) < 2):
        return spread
    if defer:
        _deferred.append((group, what, values))
        return None
    checks = [(what, values)] + _take_deferred(group)  # one all-reduce for this check and those waiting for it
    if wait:  # the earlier ones first: should one of them raise, nothing of this one is in flight
        check_agreements()
    _send(group, checks)
    if wait:
        check_agreements()
        return {name: _spreads.pop(name) for name in spread}
    return None


class Spread(int):
    """A value of agree() in which the ranks may differ: not checked; an
    agree() that waits returns its lowest and highest over the ranks."""


def value_hash(value):
    """An integer that names `value` for agree(), the same on every rank."""
    return zlib.crc32(repr(value).encode())


_deferred = []  # agreements not sent yet: (group, what, values)
_unsettled = []  # agreements sent and not yet checked: (pending, [(what, values), ...], result)
_spreads = {}  # the name of a Spread value settled -> (lowest, highest) over the ranks


def _take_deferred(group):
    """The deferred agreements on `group`, taken out of the queue."""
    taken = [(what, values) for g, what, values in _deferred if g is group]
    _deferred[:] = [d for d in _deferred if d[0] is not group]
    return taken


SLOTS = 32  # numbers per agreement: always as many, so that ranks at different checks still send equal sizes


def _message(checks):
    """The numbers one agreement sends for `checks`: first a name of what is
    checked (the checks and their values' names, equal wherever the ranks
    are at the same checks), then the values, padded with zeros to SLOTS.
    Values past the last slot but one are folded into it."""
    names = "|".join(f"{what}:{','.join(values)}" for what, values in checks)
    numbers = [v for _, values in checks for v in values.values()]
    if len(numbers) > SLOTS - 1:
        numbers = numbers[:SLOTS - 2] + [value_hash(numbers[SLOTS - 2:])]
    return [value_hash(names)] + numbers + [0] * (SLOTS - 1 - len(numbers))


def _send(group, checks):
    """One all-reduce for `checks` ([(what, values), ...]): each number of
    their message and its negation, with MAX, so that every rank learns the
    largest and the smallest."""
    numbers = _message(checks)
    named = checks[0][0] + "".join(f" (with {what})" for what, _ in checks[1:])
    # bookkeeping, not the model's memory: out of sight of tensor-counting modes
    # (whose counts gloo's worker thread would otherwise race when it lets go)
    with _disable_current_modes():
        everyone = torch.tensor(numbers + [-v for v in numbers], dtype=torch.int64)
        side = _side_groups[dist.group.WORLD if group is None else group]
        work = dist.all_reduce(everyone, op=dist.ReduceOp.MAX, group=side, async_op=True)
    _unsettled.append((Pending(work, f"the agreement on {named}", everyone), checks, named, everyone))


def check_agreements():
    """Send the deferred agreements, then wait for every agreement sent so far
    and check them, in the order sent."""
    while _deferred:
        group = _deferred[0][0]
        _send(group, _take_deferred(group))
    while _unsettled:
        pending, checks, named, everyone = _unsettled.pop(0)
        with _disable_current_modes():
            pending.wait()
        low, high = (-everyone[SLOTS:]).tolist(), everyone[:SLOTS].tolist()
        if low[0] != high[0]:
            _disagree(f"what to check: this rank is at {named}, another rank at something else (a backward "
                      "pass, an optimizer step or a gather that this rank did not reach, or reached in another order)")
        count = sum(len(values) for _, values in checks)
        direct = count if count < SLOTS else SLOTS - 2  # the values with a slot of their own, from slot 1
        differ, i = [], 1
        for what, values in checks:
            ranges = []
            for name, value in values.items():
                if isinstance(value, Spread):
                    _spreads[name] = (low[i], high[i])
                    low[i] = high[i]  # differing is allowed
                elif i <= direct and low[i] != high[i]:
                    ranges.append(f"{name} from {low[i]} to {high[i]} (this rank: {value})")
                i += 1
            if ranges:
                differ.append(f"{what}: {'; '.join(ranges)}")
        if differ or low != high:
            _disagree("; and on ".join(differ) or f"{named}: the values past the first {SLOTS - 2}")


def _disagree(what):
    _unsettled.clear()
    raise DisagreementError(f"ranks disagree on {what}. Every rank must run the same forward, backward, no_sync() "
                            "and optimizer steps, and change the same parameters")


@atexit.register
def _settle_at_exit():
    """At exit, while the interpreter is whole: settle the agreements still
    in flight (a step's own is sent without waiting; a disagreement is still
    told), then let go of the side groups and destroy the process groups.

    Why: a gloo worker thread lets go of a collective it ran only after the
    rank's wait() has returned, and letting go takes the GIL (the collective
    holds tensors and thread-local state that belong to Python). Should that
    come after the interpreter began its teardown, the thread is ended inside
    C++ and the process aborts ("terminate called without an active
    exception") after a run that went right. It happens now and then, under
    load, to the last collectives of a run: this check's, or the model's.
    Destroying a group joins its worker threads (with the GIL released), so
    they let go of everything now. torch's destroy_process_group() does that
    for the groups only it holds: the side groups are let go here, and the
    world is destroyed here when the script did not. Not after a script that
    raised: a collective of its may still wait for the other ranks, and
    joining its thread would wait with it (the run failed anyway). Deferred
    checks are dropped, and no wait lasts over a minute: sending or waiting
    now could wait for a rank that has gone."""
    global timeout
    timeout = min(timeout, timedelta(seconds=60))
    _deferred.clear()
    while _unsettled:
        try:
            check_agreements()
        except DisagreementError as e:
            print(f"tiny_zero, at exit: {e}", file=sys.stderr)
        except RuntimeError:
            pass  # CollectiveError: the group was destroyed before it ran, or a rank has gone
    if getattr(sys, "last_value", None) is not None:  # the script raised: Python printed its traceback
        return
    _side_groups.clear()  # their last references but torch's
    if dist.is_initialized():
        dist.destroy_process_group()
