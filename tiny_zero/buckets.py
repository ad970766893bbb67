"""Gradient buckets: grads that travel in one collective, laid out flat (Bucket, make_buckets),
and which may be sent now, in the order their grads become final (Buckets)."""
from itertools import compress
from operator import gt, or_

import torch

from .module import has_grad_hook, run_grad_hooks

DEFAULT_BUCKET_BYTES = 25 * 2**20  # every strategy's default bucket_bytes, as torch DDP's


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
    handle  a collective in flight for it (ddp's all-reduce, sync_params' all-gathers): Buckets.wait
    """

    def __init__(self, index, params, pad_to=1):
        self.index = index
        self.params = params
        self.offsets, self.shapes, self.strides, size = {}, {}, {}, 0
        for p in params:  # shapes are kept: a sharded parameter's own shape changes
            self.offsets[p], self.shapes[p] = size, p.shape
            self.strides[p] = contiguous_strides(p.shape)
            size += p.numel()
        self.numel = -(-size // pad_to) * pad_to  # rounded up to a multiple of pad_to
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
    """A set of the buckets' parameters, a byte at each one's index: no
    Tensor.__hash__; iterating yields them in the buckets' order."""

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
    bytearrays at that index: a backward's bookkeeping costs no Tensor.__hash__.

    flat: one buffer that holds every bucket's grads (ddp, zero1: they persist);
    None: a bucket's grads wait apart, as backward makes them (bucket.parts),
    and are flattened into its grads buffer when it is sent, which the
    strategy drops once the collective is done (zero2, zero3, fsdp, offload).
    So a bucket costs the grads made so far, as torch's grads do, until it goes.

    average_over: the number of ranks whose sum the strategy sends for. Each
    bucket handed out to be sent is divided by it first, as torch DDP divides
    before it sums: N fp16 grads can overflow in their sum where their average
    does not. In a flat buffer the division is in place (its grads may hold
    earlier averages, which the sum of N divided copies keeps).
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
        self.grad_views = None  # with a flat buffer: each parameter's view of it, made once (by index)
        if flat is not None:
            for b in buckets:
                b.grads = b.range(flat)
            self.grad_views = [self.list[k].own_view(self.list[k].grads, p) for k, p in zip(self.home, self.params)]
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

    def forward_uses(self, indices, recorded):
        """A forward that a backward may follow used the parameters at these
        indices: each use's backward is one grad contribution to come.
        `recorded` (autograd recorded it): the ranks agree on those layers,
        so the parameters are expected on every rank: their buckets are sent
        in the next backward outside no_sync on every rank, with zeros where
        no grad came (the layer's output reached this rank's loss, not another's)."""
        pending, waiting, home = self.pending, self.waiting, self.home
        marks, buckets = self.expected.marks, self.list
        for i in indices:
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
        left = self.use_done(i)
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
            place = self.grad_views[i]
            if grad is place:  # the layer wrote it there (fresh_place)
                pass
            elif got[i]:
                place.add_(grad)
            else:  # its place holds zeros (since clear()): a copy is the same sum, with one read less
                place.copy_(grad)
        got[i] = 1
        self.list[self.home[i]].fresh = True
        return place

    def fresh_place(self, param, dtype):
        """Where a layer may compute param's grad (out=), sparing put's copy: its
        view of `flat` while that holds zeros (no grad since clear()); else None."""
        if self.flat is None or dtype != self.dtype:
            return None
        i = self.index.get(id(param))
        if i is None or self.got_grad.marks[i] or has_grad_hook(param):
            return None
        place = self.grad_views[i]
        return place if place.is_contiguous() else None

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
