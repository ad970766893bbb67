"""Communication: every collective tiny_zero sends, counted, and the two
mechanisms that tell a strategy *when* to send. They make no strategy
decision: what to send, where, and when to wait and free is in the strategy
folders.

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
Buckets: gradient buckets in the order their grads become final, and which
    of them may be sent now.
GatherOrder, gather_units: zero3's and fsdp's units (a block, by default),
    and the order in which layers run, recorded on the first step: which
    unit comes next, to gather it ahead, and which the next layer still uses.
"""
import atexit
import sys
import time
import weakref
import zlib
from collections import defaultdict
from itertools import compress
from operator import gt, or_
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from .module import has_grad_hook, in_backward_pass, run_grad_hooks

DEFAULT_BUCKET_BYTES = 25 * 2**20  # every strategy's default bucket_bytes, as torch DDP's

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
    settle_agreements()  # any collective: the ranks agreed first on what they are about to run
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
    settle_agreements()
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
        settle_agreements()
    _send(group, checks)
    if wait:
        settle_agreements()
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


def settle_agreements():
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
            settle_agreements()
        except DisagreementError as e:
            print(f"tiny_zero, at exit: {e}", file=sys.stderr)
        except RuntimeError:
            pass  # CollectiveError: the group was destroyed before it ran, or a rank has gone
    if getattr(sys, "last_value", None) is not None:  # the script raised: Python printed its traceback
        return
    _side_groups.clear()  # their last references but torch's
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- buckets

def round_up(n, multiple):
    return -(-n // multiple) * multiple


class Bucket:
    """Parameters whose grads travel in one collective, laid out flat: p at
    [offsets[p], offsets[p] + p.numel()), the whole padded to numel, a multiple
    of pad_to (so N ranks get equal chunks).

    grads   this rank's grads of these parameters, flat (None: none yet)
    parts   {index: its grad}, by the parameter's index in Buckets: without a flat
            buffer, the grads made so far, each as backward made it, flattened
            into grads when the bucket is sent
    fresh   a grad was added since the bucket was last handed out to be sent
    used    a forward recorded for backward used one of its parameters since then
    handle  the strategy's collective in flight for this bucket (a Pending)
    """

    def __init__(self, index, params, pad_to=1):
        self.index = index
        self.params = params
        self.offsets, self.shapes, self.strides, size = {}, {}, {}, 0
        for p in params:  # shapes are kept: a sharded parameter's own shape changes
            self.offsets[p], self.shapes[p] = size, p.shape
            self.strides[p] = contiguous_strides(p.shape)
            size += p.numel()
        self.numel = round_up(size, pad_to)
        self.start = 0  # where this bucket begins in a flat buffer of all buckets
        self.grads = None
        self.parts = {}
        self.fresh = False
        self.used = False  # a forward that backward follows used one of its parameters since it was last sent
        self.handle = None  # the strategy's collective in flight for this bucket

    def view(self, flat, p):
        """p's place in a flat buffer that holds every bucket."""
        return self.own_view(flat[self.start:], p)

    def own_view(self, buffer, p):
        """p's place in a buffer that holds this bucket alone (flat and
        contiguous, as every buffer here is): elements [offsets[p],
        offsets[p] + p.numel()) seen in p's shape, as
        buffer[begin:end].view(shape) would, in one call instead of two (the
        gathers of zero3 and fsdp make one per parameter per gather)."""
        return buffer.as_strided(self.shapes[p], self.strides[p], buffer.storage_offset() + self.offsets[p])

    def range(self, flat):
        return flat[self.start:self.start + self.numel]

    def chunk(self, flat, rank, world_size):
        """Rank `rank`'s 1/N of this bucket inside a flat buffer of all buckets."""
        size = self.numel // world_size
        return flat[self.start + rank * size:self.start + (rank + 1) * size]


def contiguous_strides(shape):
    """The strides of a contiguous tensor of `shape` (worked out, not read off
    a tensor: one made here would count in a TensorMemory)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def make_buckets(params, bucket_bytes, pad_to=1):
    """Cut `params` (in gradient-ready order) into runs of at most
    bucket_bytes each (a larger parameter gets a bucket of its own)."""
    runs, run, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if run and size + nbytes > bucket_bytes:
            runs.append(run)
            run, size = [], 0
        run.append(p)
        size += nbytes
    if run:
        runs.append(run)
    return buckets_from_runs(runs, pad_to)


def buckets_from_runs(runs, pad_to=1):
    """Buckets for lists of parameters, laid out one after another."""
    buckets = [Bucket(i, run, pad_to) for i, run in enumerate(runs)]
    start = 0
    for b in buckets:
        b.start = start
        start += b.numel
    return buckets


class ParamSet:
    """A set of the buckets' parameters, one byte each, at its index
    (Buckets.index): adding, removing and testing a parameter costs one dict
    lookup by id(), never Tensor.__hash__, a Python function; iterating
    yields the parameters in the buckets' order."""

    def __init__(self, buckets):
        self.index, self.params = buckets.index, buckets.params
        self.marks = bytearray(len(self.params))

    def add(self, p):
        self.marks[self.index[id(p)]] = 1

    def discard(self, p):
        i = self.index.get(id(p))
        if i is not None:
            self.marks[i] = 0

    def __contains__(self, p):
        i = self.index.get(id(p))
        return i is not None and self.marks[i] == 1

    def __iter__(self):
        return compress(self.params, self.marks)

    def __len__(self):
        return self.marks.count(1)

    def __bool__(self):
        return 1 in self.marks

    def update(self, other):
        self.marks[:] = bytes(map(or_, self.marks, other.marks))

    def clear(self):
        self.marks[:] = bytes(len(self.marks))


def packed(bucket):
    """The elements of a bucket's parameters where they lie one after another
    from its start, in order (then padding): what one concatenation of their
    grads fills. None where the layout has gaps."""
    end = 0
    for p in bucket.params:
        if bucket.offsets[p] != end:
            return None
        end += bucket.shapes[p].numel()
    return end


class Buckets:
    """A strategy's gradient buckets, and when each may be sent.

    Parameters are bucketed in the order their grads become final in backward
    (for a model built layer after layer, the reverse of registration order).
    A parameter used k times in a forward gets k grad contributions in its
    backward; its grad is final after the last. A bucket may be sent once all
    its parameters are final and every bucket before it was sent, so every
    rank sends the same buckets in the same order.

    Each parameter has an index, its place in the buckets' order (params[i];
    index: {id(p): i}); what a step tracks per parameter lives in lists and
    bytearrays at that index, and where it goes in its bucket is worked out
    once: a backward's bookkeeping costs no Tensor.__hash__.

    flat: one buffer that holds every bucket's grads (ddp, zero1: they persist);
    None: a bucket's grads wait apart, as backward makes them (bucket.parts),
    and are flattened into its grads buffer when it is sent, which the
    strategy drops once the collective is done (zero2, zero3, fsdp, offload).
    So a bucket costs the grads made so far, as torch's grads do, until it goes.

    average_over: the number of ranks whose sum the strategy sends for. Each
    bucket handed out to be sent is divided by it first, as torch DDP divides
    before it sums: N fp16 grads can overflow in their sum where their average
    does not. The division comes with the copy that flattens the parts, or,
    in a flat buffer, in place (its grads may hold earlier averages, which the
    sum of N divided copies keeps).
    """

    def __init__(self, buckets, dtype, device, flat=None, average_over=1):
        self.list = buckets
        self.of = {p: b for b in buckets for p in b.params}  # for lookups when wrapping, not per step
        self.params = [p for b in buckets for p in b.params]  # index i: params[i]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.home = [k for k, b in enumerate(buckets) for _ in b.params]  # index -> its bucket's place in list
        self.places = [(b.shapes[p], b.strides[p], b.offsets[p]) for b in buckets for p in b.params]  # own_view's
        self.packed = {b: packed(b) for b in buckets}  # bucket -> its grads' elements before the padding, or None
        self.dtype, self.device, self.flat = dtype, device, flat
        self.average_over = average_over
        self.slots = None  # with a flat buffer: each parameter's view of it, made once (by index)
        if flat is not None:
            for b in buckets:
                b.grads = b.range(flat)
            self.slots = [self.list[k].own_view(self.list[k].grads, p) for k, p in zip(self.home, self.params)]
        self.got_grad = ParamSet(self)  # parameters that got a grad since clear()
        self.expected = ParamSet(self)  # used by forwards recorded for backward, since clear() or the last step
        self.pending = [0] * len(self.params)  # index -> uses whose backward has not run yet
        self.waiting = [0] * len(buckets)  # bucket's place -> its parameters with pending uses
        self.held = {}  # index of a parameter with grad hooks -> the sum of its contributions of this pass so far
        self.next = 0  # place of the next bucket to send

    def __iter__(self):
        return iter(self.list)

    def indices(self, params):
        """The indices of those of `params` in the buckets (frozen ones, another
        stage's, are in none), in their order: what a layer keeps, once."""
        return [i for i in map(self.index.get, map(id, params)) if i is not None]

    def used_in_forward(self, params, recorded=False):
        """forward_uses, for parameters rather than their indices."""
        self.forward_uses(self.indices(params), recorded)

    def forward_uses(self, slots, recorded):
        """A forward that a backward may follow used the parameters at these
        indices: each use's backward is one grad contribution to come.
        `recorded` (autograd recorded it): the ranks agree on those layers,
        so the parameters are expected on every rank: their buckets are sent
        in the next backward outside no_sync on every rank, with zeros where
        no grad came (the layer's output reached this rank's loss, not another's)."""
        pending, waiting, home = self.pending, self.waiting, self.home
        marks, buckets = self.expected.marks, self.list
        for i in slots:
            if pending[i] == 0:
                waiting[home[i]] += 1
            pending[i] += 1
            if recorded:
                buckets[home[i]].used = True
                marks[i] = 1

    def missing(self):
        """The expected parameters that got no grad on this rank (a list)."""
        return list(compress(self.params, map(gt, self.expected.marks, self.got_grad.marks)))

    def add(self, param, grad, send=True):
        """Add one grad contribution into param's bucket; return the buckets
        that may be sent now (none when `send` is False: under no_sync). A
        parameter with grad hooks: its contributions are held and summed, and
        the sum goes in through its hooks after the last one (as autograd
        sums a leaf's grads before it runs them), or at the end of the
        backward pass (add_held)."""
        i = self.index.get(id(param))
        if i is None:
            raise RuntimeError("a grad came for a parameter that was frozen (requires_grad=False) when the model "
                               "was wrapped: tiny_zero reads requires_grad once, when wrapping; set it first")
        left = self.pending[i]  # use_done(i), inline: once per grad
        if left > 0:
            self.pending[i] = left - 1
            if left == 1:
                self.waiting[self.home[i]] -= 1
        if has_grad_hook(param):
            held = self.held.get(i)
            self.held[i] = grad if held is None else held.add_(grad)
            if left > 1:  # more contributions to come
                return []
            self.take_held(i)
        else:
            self.put(i, grad)
        return self.ready() if send else []

    def use_done(self, i):
        """One use of the parameter at index i has had its backward (or skipped
        it): returns the uses pending before."""
        left = self.pending[i]
        if left > 0:
            self.pending[i] = left - 1
            if left == 1:
                self.waiting[self.home[i]] -= 1
        return left

    def skip(self, params, send=True):
        """One use of each of `params` whose backward did not come on this
        rank (zero3, fsdp: Wrapper.skip_to): counted done, with no grad;
        returns the buckets that may be sent now, as add."""
        for i in self.indices(params):
            if self.use_done(i) == 1 and i in self.held:  # its last use: what came goes in
                self.take_held(i)
        return self.ready() if send else []

    def add_held(self):
        """The end of a backward pass: the held grads whose last contribution
        did not come (a use whose output reached no loss) go in now."""
        for i in list(self.held):
            self.take_held(i)

    def take_held(self, i):
        """A held grad, summed, goes in through its parameter's hooks."""
        run_grad_hooks(self.params[i], self.held.pop(i), lambda grad: self.put(i, grad))

    def put(self, i, grad):
        """Add `grad` into the place of the parameter at index i; returns what this rank holds there now."""
        got = self.got_grad.marks
        if self.flat is None:
            place = self.keep_part(i, grad)
        else:
            place = self.slots[i]
            if got[i]:
                place.add_(grad)
            else:  # its place holds zeros (since clear()): a copy is the same sum, with one read less
                place.copy_(grad)
        got[i] = 1
        self.list[self.home[i]].fresh = True
        return place

    def ready(self):
        waiting, k = self.waiting, self.next
        if k == len(waiting) or waiting[k]:  # most grads: the next bucket still waits
            return []
        while k < len(waiting) and waiting[k] == 0:
            k += 1
        out, self.next = self.list[self.next:k], k
        return self._to_send(out)

    def unsent(self):
        """The buckets backward did not hand out (their parameters got no
        grad after the others): send them now."""
        rest = self.list[self.next:]
        self.next = len(self.list)
        return self._to_send(rest)

    def keep_part(self, i, grad):
        bucket = self.list[self.home[i]]
        part = bucket.parts.get(i)
        if part is None:  # the grad as backward made it, no copy (a new tensor, in the bucket's dtype)
            if grad.dtype != self.dtype or not grad.is_contiguous():
                grad = grad.to(self.dtype, memory_format=torch.contiguous_format)
            part = bucket.parts[i] = grad
        else:
            part.add_(grad)
        return part

    def _to_send(self, buckets):
        """Those used by a recorded forward or given a grad since they were
        last sent, divided by average_over: a bucket with neither is skipped,
        alike on every rank (every rank ran the same layers). A used bucket
        goes out where no grad came, so every rank sends the same buckets."""
        sent = [b for b in buckets if b.fresh or b.used]
        for b in sent:
            b.fresh = b.used = False
            if self.flat is None:
                self.flatten(b)
            elif self.average_over > 1:
                b.grads.div_(self.average_over)
        return sent

    def flatten(self, bucket):
        """A bucket about to be sent: its parts divided by average_over, into
        one flat buffer (zeros where a parameter got no grad, and in the padding)."""
        filled = self.packed[bucket]
        if filled is not None and len(bucket.parts) == len(bucket.params):  # every place has a grad: one pass
            parts = [bucket.parts[i] for i in sorted(bucket.parts)]  # in layout order
            if filled < bucket.numel:
                parts.append(torch.zeros(bucket.numel - filled, dtype=self.dtype, device=self.device))
            bucket.grads = torch._C._nn.flatten_dense_tensors(parts)
            if self.average_over > 1:
                bucket.grads.div_(self.average_over)
            bucket.parts = {}
            return
        bucket.grads = grads = torch.zeros(bucket.numel, dtype=self.dtype, device=self.device)
        if bucket.parts:
            torch._foreach_copy_([self.own_view(grads, i) for i in bucket.parts], list(bucket.parts.values()))
            if self.average_over > 1:
                grads.div_(self.average_over)  # the same quotients as part / N, in one pass
        bucket.parts = {}

    def own_view(self, buffer, i):
        """Bucket.own_view of the parameter at index i, from what was worked out once."""
        shape, strides, offset = self.places[i]
        return buffer.as_strided(shape, strides, buffer.storage_offset() + offset)

    def wait(self):
        """Wait for every bucket's collective in flight; returns those buckets."""
        done = [b for b in self.list if b.handle is not None]
        for b in done:
            b.handle.wait()
            b.handle = None
        return done

    def end_backward(self):
        """A backward pass is over: the next one counts uses afresh."""
        self.next = 0
        self.pending = [0] * len(self.params)
        self.waiting = [0] * len(self.list)
        self.held.clear()

    def clear(self, keep_got_grad=False):
        """zero_grad: the local grads go (zeroed where they persist); with
        keep_got_grad (zero_grad(set_to_none=False)) parameters keep having a grad."""
        if not keep_got_grad:
            self.got_grad.clear()
            self.expected.clear()
        for b in self.list:
            b.fresh = False
            if self.flat is None:
                b.grads, b.parts = None, {}
        if self.flat is not None:
            self.flat.zero_()


# ---------------------------------------------------------------- gather order

class GatherOrder:
    """When zero3 and fsdp gather and free their units (what one gather brings:
    a transformer block's parameters, say; `units_of` maps each layer to the
    units it uses).

    The order in which layers run forward is recorded on the first step that
    trains (a layer called twice appears twice; every rank records the same
    order). Afterwards each layer `arrive`s (forward, or walking the order
    backwards in backward); `next_unit` says which unit comes after the ones
    gathered, so the strategy can gather it ahead, and `still_needed` which
    units the coming layer uses, so it can free the others. A layer of the
    unit gathered last costs a step along the order, nothing more.

    A forward inside a backward pass is activation checkpointing's recompute
    of the layers whose backward comes next: it leaves the backward walk where
    it is, so the unit it gathers stays for that backward, and the unit
    before it is the one gathered ahead. A layer that the order does not hold
    leaves the walk where it is too.

    A layer that needs a unit the order did not predict (eval taking another
    path, a layer skipped this step, the recording step) is gathered on the
    spot; before that every rank agrees that it is the same layer, so a rank
    that really went another way gets a clear error, not mismatched collectives.
    """

    def __init__(self, units_of):
        self.units_of = units_of  # in module order
        self.following = dict(zip(units_of, list(units_of)[1:]))  # the next layer in module order
        self.order = []
        self.recording = True
        self.backward = False  # walking the order backwards: in a backward pass, recomputes included
        self.position = 0  # forward: layers done; backward: layers left (0 <= position <= len(order))
        self.last = None  # the layer that arrived last

    def arrive(self, layer, expected, backward=False, training=False):
        """`layer` is about to run (in its backward if `backward`); `expected`:
        what it needs was gathered or started ahead; `training`: a forward
        that a backward may follow."""
        in_backward = backward or in_backward_pass()
        if in_backward and self.recording:  # the first backward ends the recording; it walks back from the end
            self.recording = False
            self.position = len(self.order)
        if self.recording or not expected:
            agree(f"the layer to gather in {'backward' if backward else 'forward'}", layer=layer.index)
        self.last = layer
        if self.recording:
            if training:  # only a forward that backward will follow sets the order
                self.order.append(layer)
            return
        self.backward = in_backward
        if backward:
            self.step_back(layer)
        elif not in_backward:
            self.step_forward(layer)

    def step_forward(self, layer):
        if self.position < len(self.order) and self.order[self.position] is layer:
            self.position += 1
        elif layer in self.order:
            self.position = self.order.index(layer) + 1

    def step_back(self, layer):
        if self.position > 0 and self.order[self.position - 1] is layer:
            self.position -= 1
        elif layer in self.order:
            self.position = len(self.order) - 1 - self.order[::-1].index(layer)

    def next_layer(self):
        """The layer expected after the one that just ran (None: the pass ends).
        While recording, the guess is the next layer in module order."""
        if self.recording:
            return self.following.get(self.last)
        if self.backward:
            return self.order[self.position - 1] if self.position > 0 else None
        return self.order[self.position] if self.position < len(self.order) else None

    def next_unit(self, gathered):
        """The first unit that the layers expected next need and that is not
        in `gathered` (None: none, or recording, when nothing is predicted)."""
        if self.recording:
            return None
        step = -1 if self.backward else 1
        i = self.position - 1 if self.backward else self.position
        while 0 <= i < len(self.order):
            for unit in self.units_of[self.order[i]]:
                if unit not in gathered:
                    return unit
            i += step
        return None

    def still_needed(self):
        """The units the next layer uses: the others can be freed."""
        layer = self.next_layer()
        return self.units_of[layer] if layer is not None else ()


def gather_units(module, layers, units):
    """[(module, [its layers])]: what each gather brings. `units`: module classes
    or names (a module's path, or its class name); None: the model's repeated
    blocks, found as the children of a ModuleList that are all of one class.
    A layer in no unit is a unit of its own."""
    if units is None:
        chosen = next(([m for m in lst] for lst in module.modules()
                       if isinstance(lst, torch.nn.ModuleList) and len(lst) > 1
                       and len({type(c) for c in lst}) == 1), [])
    else:
        wanted = [u if isinstance(u, (str, type)) else type(u) for u in units]
        chosen = [m for path, m in module.named_modules()
                  if any(w == path or w == type(m).__name__ if isinstance(w, str) else isinstance(m, w)
                         for w in wanted)]
    owner = {}
    for m in chosen:
        for inner in m.modules():
            owner.setdefault(inner, m)  # the outermost chosen module holds a layer
    grouped = {}
    for layer in layers:
        grouped.setdefault(owner.get(layer, layer), []).append(layer)
    return list(grouped.items())
