"""ZeRO-3, inter-tensor: each whole parameter tensor is owned by one rank.

A rank holds: the tensors it owns (owner_table below: largest first, each to
the least-loaded rank, the same table on every rank), their grads and their
optimizer state; other parameters are empty except while a layer uses them.
Collectives: broadcast from the owner before each layer's forward and again
before its backward, the next layer prefetched (module.py); reduce of each
per-owner grad bucket to its owner during backward. The owners step their
own tensors: nothing is gathered after the step.
"""
import torch

from .. import comm
from ..buckets import DEFAULT_BUCKET_BYTES, BucketedGrads, buckets_from_runs
from ..materialize import full_value, set_data
from ..gather import GatheredWrapper, Prefetcher
from ..strategy import Piece
from .layers import LAYER_CLASSES, Broadcasts


class Zero3(GatheredWrapper):
    layer_classes = LAYER_CLASSES

    def __init__(self, module, bucket_bytes=DEFAULT_BUCKET_BYTES, **options):
        super().__init__(module, **options)  # options: mixed_precision, reduce_dtype, loss_scaler, device
        shapes = [(n, p.numel()) for n, p in self.named_params]
        table = owner_table(shapes, self.world_size)  # STRATEGY: from names and sizes alone, alike on every rank
        self.owner = {p: table[name] for name, p in self.named_params}
        self.full_shape = {p: p.shape for _, p in self.named_params}
        dtype = self.named_params[0][1].dtype
        self.empty = torch.empty(0, dtype=dtype, device=self.device)
        params = [p for _, p in self.named_params][::-1]  # gradient-ready order
        self.buckets = owner_buckets(params, self.owner, bucket_bytes)
        for name, p in self.named_params:
            self.keep_own_part(name, p)
        self.grads = BucketedGrads(self, self.buckets, self.reduce_dtype, self.device)
        self.queue = self.grads.queue
        self.prefetcher = Prefetcher(lambda layer: Broadcasts(self, layer))

    def keep_own_part(self, name, p):
        """Owners keep (or materialise) the tensor; everyone else keeps nothing."""
        owned = self.owner[p] == self.rank  # STRATEGY: whole tensors, one owner each
        if p.is_meta:  # the model's own init gives every owner the same value a single device would
            set_data(p, full_value(self.module, name, p, self.device) if owned else self.empty)
            return
        value = p.data.to(self.device)
        comm.broadcast(value, src=0)  # every rank starts from rank 0's weights
        set_data(p, value if owned else self.empty)

    def owns(self, p):
        return self.owner[p] == self.rank

    def send_bucket(self, bucket, full_grads):
        return comm.reduce(full_grads, dst=bucket.owner, async_op=True)  # STRATEGY: sum at the owner

    def bucket_done(self, bucket, full_grads):
        if bucket.owner == self.rank:  # STRATEGY: the owner keeps the sum; the others drop it
            for p in bucket.params:
                self.grads_of[p] = bucket.own_view(full_grads, p)

    def optimizer_params(self):
        return [p for _, p in self.named_params if self.owns(p)]

    def zero_grads(self):
        self.grads_of.clear()
        self.grads.clear()

    def pieces(self):
        return [Piece(name, p.shape, 0, p.numel(), p, 0) for name, p in self.named_params if self.owns(p)]

    @torch.no_grad()
    def gather_full(self):
        full = {}
        for _, p in self.named_params:
            owned = self.owns(p)
            value = self.master(p) if owned else torch.empty(self.full_shape[p], device=self.device)
            comm.broadcast(value, src=self.owner[p])  # the fp32 master, from its owner
            full[p] = value.cpu().clone()
        return full


def owner_buckets(params, owner, bucket_bytes):
    """Buckets of grads bound for one owner each, at most bucket_bytes, ordered
    by when their last grad becomes ready."""
    runs, open_runs, last = [], {}, {}
    for position, p in enumerate(params):
        run = open_runs.setdefault(owner[p], [])
        if run and sum(q.numel() * q.element_size() for q in run) + p.numel() * p.element_size() > bucket_bytes:
            runs.append((last[owner[p]], run))  # ordered by its own last grad
            run = open_runs[owner[p]] = []
        run.append(p)
        last[owner[p]] = position
    runs += [(last[r], run) for r, run in open_runs.items()]
    runs.sort(key=lambda item: item[0])
    buckets = buckets_from_runs([run for _, run in runs])
    for b in buckets:
        b.owner = owner[b.params[0]]
    return buckets


def owner_table(named_shapes, world_size):
    """{name: rank} for [(name, numel), ...], balanced by numel."""
    load = [0] * world_size
    owner = {}
    for name, numel in sorted(named_shapes, key=lambda item: (-item[1], item[0])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += numel
    return owner


def loads(owner, named_shapes, world_size):
    """Elements owned by each rank."""
    load = [0] * world_size
    for name, numel in named_shapes:
        load[owner[name]] += numel
    return load
