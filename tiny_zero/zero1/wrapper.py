"""ZeRO-1: shard the optimizer state.

A rank holds: every trainable parameter, in one flat buffer (flat_params),
cut into buckets, each padded to a multiple of N and cut into N chunks; the
full local grads through backward (flat_grads, the same layout), whose own
chunks then hold the averaged grads; the optimizer state of its own chunk of
every bucket, 1/N of the whole. Frozen parameters stay whole on every rank,
never sent.

    flat_params  [ bucket 0: r0 | r1 ][ bucket 1: r0 | r1 ] ...   (every rank)
    shards       rank r's chunks: what its optimizer steps

Collectives: broadcast of rank 0's parameters at wrap time; at the end of the
backward pass, one reduce_scatter per bucket (each rank receives the sum of
its own chunk, in place, into its chunk of flat_grads); after the optimizer step, one all_gather per bucket brings
every rank's updated chunks to every rank (sync_params).
"""
import torch

from .. import comm, holding
from ..buckets import DEFAULT_BUCKET_BYTES, Buckets, make_buckets
from ..holding import HeldInChunks
from ..step import Wrapper
from .layers import LAYER_CLASSES


class Zero1(HeldInChunks, Wrapper):  # HeldInChunks: grad_attr, pieces, full_values of the chunks
    layer_classes = LAYER_CLASSES

    def __init__(self, module, bucket_bytes=DEFAULT_BUCKET_BYTES, **options):
        super().__init__(module, **options)  # options: mixed_precision, reduce_dtype, loss_scaler, device
        n = self.world_size
        buckets = make_buckets(self.trainable[::-1], bucket_bytes, pad_to=n)  # backward runs the last layer first
        self.flat_params = holding.flatten_params(self, buckets, self.trainable)
        holding.keep_whole(self, self.frozen)
        self.flat_grads = torch.zeros_like(self.flat_params, dtype=self.reduce_dtype)  # STRATEGY: full, kept through backward
        self.buckets = Buckets(buckets, self.reduce_dtype, self.device, flat=self.flat_grads,
                               average_over=self.world_size)  # STRATEGY: each bucket / N, before it is sent
        self.index_params(self.buckets)  # each trainable parameter's place in them (wrapping.py)
        chunks = [b.chunk(self.flat_params, self.rank, n) for b in buckets]  # STRATEGY: this rank steps 1/N
        self.shards = holding.fp32_shards(self, chunks)
        self.grads = {shard: b.chunk(self.flat_grads, self.rank, n) for shard, b in zip(self.shards, buckets)}
        self.holds_average = False  # the chunks of self.grads hold averages (from a backward since zero_grad)
        self.scaled = False  # ... multiplied by N, for the backward that adds into them

    def backward_started(self):
        if not self.in_backward and self.holds_average:  # averages of an earlier backward, no zero_grad since
            for chunk in self.grads.values():  # the sum over ranks then has N x them, and / N keeps them:
                chunk.mul_(self.world_size)    # (N·avg + Σ grads) / N = avg + the new average, as in ddp
            self.holds_average, self.scaled = False, True
        super().backward_started()

    def stepping(self, written):
        if self.scaled:
            raise RuntimeError("an optimizer step after a backward inside no_sync() with no backward outside it since, "
                               "and no zero_grad() before: zero1 keeps the grads of neither, averaged; run one backward "
                               "outside no_sync() first")
        return super().stepping(written)

    @torch.no_grad()
    def after_backward(self):
        sent = []
        for bucket in self.buckets.unsent():  # every bucket with grads, after backward
            chunk = bucket.chunk(self.flat_grads, self.rank, self.world_size)
            sent.append((bucket, chunk, comm.reduce_scatter(chunk, bucket.grads, async_op=True)))  # STRATEGY: my chunk's sum
        for bucket, chunk, handle in sent:
            handle.wait()  # the sum of grads divided by N: the average
            self.zero_others(bucket)  # they were sent: the next backward starts from zero there
        if self.scaled:  # buckets this backward gave no grad: their averages, back from N x
            for bucket in set(self.buckets) - {bucket for bucket, _, _ in sent}:
                bucket.chunk(self.flat_grads, self.rank, self.world_size).div_(self.world_size)
        self.holds_average, self.scaled = True, False

    def zero_others(self, bucket):
        """Zero the chunks of a bucket's grads that other ranks own."""
        grads, size = bucket.range(self.flat_grads), bucket.numel // self.world_size
        grads[:self.rank * size].zero_()
        grads[(self.rank + 1) * size:].zero_()

    @torch.no_grad()
    def sync_params(self):
        for bucket in self.buckets:
            chunk = bucket.chunk(self.flat_params, self.rank, self.world_size)
            bucket.handle = comm.all_gather(bucket.range(self.flat_params), chunk, async_op=True)  # STRATEGY
        self.buckets.wait()  # STRATEGY: every rank's updated chunks, before the next forward

    # ------------------------------------------------------------ zero_grad, p.grad, state dicts (torch's conventions)

    def clear_grads(self, set_to_none):
        self.holds_average = self.scaled = False  # Buckets.clear zeroes flat_grads, averages included
