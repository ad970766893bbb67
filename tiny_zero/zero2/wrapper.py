"""ZeRO-2: shard the optimizer state and the gradients.

A rank holds: all parameters (in flat_params), its 1/N chunk of the averaged
gradients (grad_shard), optimizer state for that chunk, and during backward
the full gradients of the buckets not yet sent and done: typically the one
being filled and the one in flight, plus any bucket still waiting for a
parameter's last contribution (a tied weight's bucket waits all backward).
Collectives: broadcast of rank 0's parameters at wrap time; one
reduce_scatter per bucket, started in backward as soon as the bucket is
complete (module.py); after the step, one all_gather per bucket
(FlatShardWrapper.after_step).
"""
import torch

from .. import comm
from ..buckets import DEFAULT_BUCKET_BYTES, BucketedGrads
from ..flat_shards import FlatShardWrapper
from .layers import LAYER_CLASSES


class Zero2(FlatShardWrapper):
    layer_classes = LAYER_CLASSES

    def __init__(self, module, bucket_bytes=DEFAULT_BUCKET_BYTES, **options):
        super().__init__(module, bucket_bytes, **options)
        n = self.world_size
        self.grad_shard = torch.zeros(self.flat_params.numel() // n, dtype=self.reduce_dtype, device=self.device)
        self.grads_of = {shard: self.grad_shard[b.start // n:(b.start + b.numel) // n]
                         for shard, b in zip(self.shard_params, self.buckets)}
        self.grads = BucketedGrads(self, self.buckets, self.reduce_dtype, self.device)
        self.queue = self.grads.queue

    def send_bucket(self, bucket, full_grads):
        shard = self.grads_of[self.shard_params[bucket.index]]
        return comm.reduce_scatter(shard, full_grads, async_op=True)  # STRATEGY: each rank gets its chunk's sum

    def bucket_done(self, bucket, full_grads):
        pass  # STRATEGY: nothing kept: the full grads are freed, only the chunk in grad_shard stays

    @torch.no_grad()
    def sync_grads(self):
        self.grads.finish()
        self.grad_shard.div_(self.world_size)  # sum -> mean

    def zero_grads(self):
        self.grads.clear()
