"""ZeRO-1: shard the optimizer state.

A rank holds: all parameters (in flat_params), all gradients (in flat_grads,
kept through backward), and optimizer state for its 1/N chunk of every bucket
(../flat_shards.py explains the layout).
Collectives: broadcast of rank 0's parameters at wrap time; after backward, one
reduce_scatter per bucket, in place: each rank's chunk of flat_grads receives
the sum of that chunk over ranks (the rest of flat_grads is then stale);
after the step, one all_gather per bucket (FlatShardWrapper.after_step)
brings the updated parameters back.
"""
import torch

from .. import comm
from ..buckets import DEFAULT_BUCKET_BYTES
from ..flat_shards import FlatShardWrapper
from .layers import LAYER_CLASSES


class Zero1(FlatShardWrapper):
    layer_classes = LAYER_CLASSES

    def __init__(self, module, bucket_bytes=DEFAULT_BUCKET_BYTES, **options):
        super().__init__(module, bucket_bytes, **options)
        # full grads, laid out as flat_params
        self.flat_grads = torch.zeros(self.flat_params.numel(), dtype=self.reduce_dtype, device=self.device)
        self.grads_of = {shard: self.my_chunk(b) for shard, b in zip(self.shard_params, self.buckets)}

    def my_chunk(self, bucket):
        return bucket.chunk(self.flat_grads, self.rank, self.world_size)

    def send_bucket(self, bucket, full_grads):
        return comm.reduce_scatter(self.my_chunk(bucket), full_grads, async_op=True)  # STRATEGY: in place

    @torch.no_grad()
    def sync_grads(self):
        for bucket in self.buckets:  # all buckets, after backward
            bucket.handle = self.send_bucket(bucket, bucket.range(self.flat_grads))
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.handle = None
        for g in self.local_grads():
            g.div_(self.world_size)  # sum -> mean

    def zero_grads(self):
        self.flat_grads.zero_()
