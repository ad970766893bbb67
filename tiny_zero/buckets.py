"""Gradient buckets: runs of parameters whose grads travel in one collective.

Parameters are put in buckets in the order their gradients become ready in
backward, which for a model built layer after layer is the reverse of
registration order. A bucket can be sent once every one of its parameters has
received its last gradient contribution of the step. A parameter used twice
in a step (tied weights, a layer called twice) is counted per use, so it is
final only after its last use's backward. Buckets are sent strictly in order,
so every rank issues the same collectives in the same order.
"""
from collections import defaultdict

import torch

DEFAULT_BUCKET_BYTES = 25 * 2**20  # every strategy's default bucket_bytes, as torch DDP's


def round_up(n, multiple):
    return -(-n // multiple) * multiple


class Bucket:
    def __init__(self, index, params, pad_to=1):
        self.index = index
        self.params = params
        self.offsets, self.shapes, size = {}, {}, 0
        for p in params:  # shapes are kept: a sharded parameter's own shape changes
            self.offsets[p], self.shapes[p] = size, p.shape
            size += p.numel()
        self.numel = round_up(size, pad_to)  # padded so N ranks get equal chunks
        self.start = 0  # where this bucket begins in a flat buffer of all buckets
        self.handle = None  # the collective in flight

    def view(self, flat, p):
        """p's place in a flat buffer that holds every bucket."""
        return self.own_view(flat[self.start:], p)

    def own_view(self, buffer, p):
        """p's place in a buffer that holds this bucket alone."""
        begin, shape = self.offsets[p], self.shapes[p]
        return buffer[begin:begin + shape.numel()].view(shape)

    def chunk(self, flat, rank, world_size):
        """Rank `rank`'s 1/N of this bucket inside a flat buffer of all buckets."""
        size = self.numel // world_size
        return flat[self.start + rank * size:self.start + (rank + 1) * size]

    def range(self, flat):
        return flat[self.start:self.start + self.numel]


def make_buckets(params, bucket_bytes, pad_to=1):
    """Cut `params` (in gradient-ready order) into buckets of at most
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


class BucketQueue:
    """Decides when each bucket may be sent: all its grads final, and every
    bucket before it already sent."""

    def __init__(self, buckets):
        self.buckets = buckets
        self.bucket_of = {p: b for b in buckets for p in b.params}
        self.pending = defaultdict(int)  # param -> uses whose backward has not run yet
        self.waiting = {b: 0 for b in buckets}  # bucket -> params with pending uses
        self.next = 0  # index of the next bucket to send

    def used_in_forward(self, params):
        for p in params:
            if self.pending[p] == 0:
                self.waiting[self.bucket_of[p]] += 1
            self.pending[p] += 1

    def grad_added(self, p, send):
        """Record one backward contribution to p; return the buckets to send now."""
        self.pending[p] -= 1
        if self.pending[p] == 0:
            self.waiting[self.bucket_of[p]] -= 1
        return self.ready_buckets() if send else []

    def ready_buckets(self):
        ready = []
        while self.next < len(self.buckets) and self.waiting[self.buckets[self.next]] == 0:
            ready.append(self.buckets[self.next])
            self.next += 1
        return ready

    def unsent_buckets(self):
        """Buckets never sent this step (their params got no grad): send them now."""
        rest = self.buckets[self.next:]
        self.next = len(self.buckets)
        return rest

    def new_step(self):
        """After the optimizer step: forget uses whose backward never ran."""
        self.next = 0
        self.pending.clear()
        self.waiting = {b: 0 for b in self.buckets}


class BucketedGrads:
    """Full gradients that live only in per-bucket temporary buffers: from a
    bucket's first grad until its collective completes (ZeRO-2, ZeRO-3, FSDP).

    A complete bucket is sent at once with wrapper.send_bucket(bucket, buffer),
    which returns the async handle; the bucket before it is then waited for
    and handed to wrapper.bucket_done(bucket, buffer), after which its buffer
    is dropped. So during backward at most two buckets of full grads exist.
    """

    def __init__(self, wrapper, buckets, dtype, device):
        self.wrapper = wrapper
        self.buckets = buckets
        self.queue = BucketQueue(buckets)
        self.dtype, self.device = dtype, device
        self.buffers = {}

    def add(self, param, grad):
        bucket = self.queue.bucket_of[param]
        bucket.own_view(self.buffer(bucket), param).add_(grad)
        for ready in self.queue.grad_added(param, send=self.wrapper.require_grad_sync):
            self.send(ready)
            before = self.buckets.index(ready) - 1  # in sending order (a bucket's index is its layout place)
            if before >= 0:
                self.wait(self.buckets[before])  # it had this bucket's compute to finish

    def buffer(self, bucket):
        if bucket not in self.buffers:
            self.buffers[bucket] = torch.zeros(bucket.numel, dtype=self.dtype, device=self.device)
        return self.buffers[bucket]

    def send(self, bucket):
        bucket.handle = self.wrapper.send_bucket(bucket, self.buffer(bucket))

    def wait(self, bucket):
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle = None
            self.wrapper.bucket_done(bucket, self.buffers.pop(bucket))  # then the full grads are freed

    def finish(self):
        """Send what backward did not (params that got no grad), wait for all."""
        for bucket in self.queue.unsent_buckets():
            self.send(bucket)
        for bucket in self.buckets:
            self.wait(bucket)

    def clear(self):
        """Drop grads accumulated under no_sync that were never sent."""
        self.buffers.clear()
