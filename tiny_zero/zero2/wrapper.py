"""ZeRO-2: shard the optimizer state and the gradients.

A rank holds: every trainable parameter, in one flat buffer (flat_params),
cut into buckets, each padded to a multiple of N and cut into N chunks; the
averaged grads (grad_chunks) and the optimizer state of its own chunk of every
bucket, 1/N of the whole; and during backward the full local grads of the
buckets not yet sent and finished: typically the one being filled and the one
in flight, plus any bucket still waiting for a parameter's last grad (a tied
weight's bucket waits all backward). Frozen parameters stay whole on every
rank, never sent.
Collectives: broadcast of rank 0's parameters at wrap time; one
reduce_scatter per bucket, started in backward as soon as the bucket's grads
are final (layers.py); after the optimizer step, one all_gather per bucket
(sync_params).
"""
import torch

from .. import comm, holding
from ..buckets import DEFAULT_BUCKET_BYTES, Buckets, make_buckets
from ..holding import HeldInChunks
from ..step import Wrapper
from .layers import LAYER_CLASSES


class Zero2(HeldInChunks, Wrapper):  # HeldInChunks: grad_attr, pieces, full_values of the chunks
    layer_classes = LAYER_CLASSES

    def __init__(self, module, bucket_bytes=DEFAULT_BUCKET_BYTES, **options):
        super().__init__(module, **options)  # options: mixed_precision, reduce_dtype, loss_scaler, device
        n = self.world_size
        buckets = make_buckets(self.trainable[::-1], bucket_bytes, pad_to=n)  # backward runs the last layer first
        self.flat_params = holding.flatten_params(self, buckets, self.trainable)
        holding.keep_whole(self, self.frozen)
        self.buckets = Buckets(buckets, self.reduce_dtype, self.device,  # a bucket's grads: from its first grad until sent
                               average_over=self.world_size)  # STRATEGY: each bucket / N, as it is flattened to be sent
        self.index_params(self.buckets)  # each trainable parameter's place in them (wrapping.py)
        chunks = [b.chunk(self.flat_params, self.rank, n) for b in buckets]  # STRATEGY: this rank steps 1/N
        self.shards = holding.fp32_shards(self, chunks)
        self.grad_chunks = torch.zeros(self.flat_params.numel() // n, dtype=self.reduce_dtype, device=self.device)
        self.grads = {shard: self.grad_chunks[b.start // n:(b.start + b.numel) // n]
                      for shard, b in zip(self.shards, buckets)}
        self.unfinished = []  # (bucket, reduce-scatter, its averaged grads, the sum) in flight

    @torch.no_grad()
    def send_bucket(self, bucket):
        """Send a bucket whose grads are final."""
        dest = self.grads[self.shards[bucket.index]]
        out = self.reduce_target(dest)
        handle = comm.reduce_scatter(out, bucket.grads, async_op=True)  # STRATEGY: each rank gets its chunk's sum
        self.queue_finish(bucket, handle, dest, out)

    def finish(self, bucket, handle, dest, out):
        handle.wait()
        self.add_to_grads(dest, out)
        bucket.grads = None  # STRATEGY: free the bucket's full grads; only this rank's chunk of the sum stays

    after_backward = Wrapper.finish_sends

    @torch.no_grad()
    def sync_params(self):
        for bucket in self.buckets:
            chunk = bucket.chunk(self.flat_params, self.rank, self.world_size)
            bucket.handle = comm.all_gather(bucket.range(self.flat_params), chunk, async_op=True)  # STRATEGY
        self.buckets.wait()  # STRATEGY: every rank's updated chunks, before the next forward

    # ------------------------------------------------------------ zero_grad, p.grad, state dicts (torch's conventions)

    def clear_grads(self, set_to_none):
        self.grad_chunks.zero_()  # the buckets' full grads: Buckets.clear drops them
