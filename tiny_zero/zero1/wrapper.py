"""ZeRO-1: shard the optimizer state.

A rank holds: every trainable parameter, in one flat buffer (flat_params),
cut into buckets, each padded to a multiple of N and cut into N chunks; the
full local grads through backward (flat_grads, the same layout); the averaged
grads (grad_shard) and the optimizer state of its own chunk of every bucket,
1/N of the whole. Frozen parameters stay whole on every rank, never sent.

    flat_params  [ bucket 0: r0 | r1 ][ bucket 1: r0 | r1 ] ...   (every rank)
    shards       rank r's chunks: what its optimizer steps

Collectives: broadcast of rank 0's parameters at wrap time; at the end of the
backward pass, one reduce_scatter per bucket (each rank receives the sum of
its own chunk); after the optimizer step, one all_gather per bucket brings
every rank's updated chunks to every rank (sync_params).
"""
import torch

from .. import comm
from ..comm import DEFAULT_BUCKET_BYTES, Buckets, make_buckets
from ..strategy import Wrapper
from .layers import LAYER_CLASSES


class Zero1(Wrapper):
    layer_classes = LAYER_CLASSES

    def __init__(self, module, bucket_bytes=DEFAULT_BUCKET_BYTES, **options):
        super().__init__(module, **options)  # options: mixed_precision, reduce_dtype, loss_scaler, device
        n = self.world_size
        buckets = make_buckets(self.trainable[::-1], bucket_bytes, pad_to=n)  # backward runs the last layer first
        self.flat_params = self.flatten(buckets, self.trainable)
        self.keep_whole(self.frozen)
        self.flat_grads = torch.zeros_like(self.flat_params, dtype=self.reduce_dtype)  # STRATEGY: full, kept through backward
        self.buckets = Buckets(buckets, self.reduce_dtype, self.device, flat=self.flat_grads)
        chunks = [b.chunk(self.flat_params, self.rank, n) for b in buckets]  # STRATEGY: this rank steps 1/N
        self.shards = self.fp32_shards(chunks)
        self.grad_shard = torch.zeros(self.flat_params.numel() // n, dtype=self.reduce_dtype, device=self.device)
        self.grads = {shard: self.grad_shard[b.start // n:(b.start + b.numel) // n]
                      for shard, b in zip(self.shards, buckets)}

    @torch.no_grad()
    def reduce_grads(self):
        sent = []
        for bucket in self.buckets.unsent():  # every bucket with grads, after backward
            dest = self.grads[self.shards[bucket.index]]
            out = self.reduce_target(dest)
            sent.append((comm.reduce_scatter(out, bucket.grads, async_op=True), dest, out))  # STRATEGY: my chunk's sum
        for handle, dest, out in sent:
            handle.wait()
            self.average_into(dest, out)
        self.flat_grads.zero_()  # the local grads were sent: the next backward starts from zero

    def clear_grads(self, set_to_none):
        self.grad_shard.zero_()  # flat_grads: Buckets.clear zeroes it

    def grad_attr(self, param):
        return self.sharded_grad(param)

    def pieces(self):
        return self.chunk_pieces()

    def gather_full(self):
        return self.gather_chunks()

    @torch.no_grad()
    def sync_params(self):
        for bucket in self.buckets:
            chunk = bucket.chunk(self.flat_params, self.rank, self.world_size)
            bucket.handle = comm.all_gather(bucket.range(self.flat_params), chunk, async_op=True)  # STRATEGY
        self.buckets.wait()  # STRATEGY: every rank's updated chunks, before the next forward
