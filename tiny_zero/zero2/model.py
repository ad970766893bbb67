"""ZeRO-2: shard the optimizer state and the gradients.

A rank holds: all parameters (in flat_params), its 1/N chunk of the averaged
gradients (grad_shard), optimizer state for that chunk, and during backward
the full gradients of at most the bucket being filled and the one in flight.
Collectives: broadcast of rank 0's parameters at wrap time; one
reduce_scatter per bucket, started in backward as soon as the bucket is
complete (module.py); after the step, one all_gather per bucket (optim.py).
"""
import torch

from .. import comm
from ..buckets import BucketQueue
from ..flat_shards import FlatShardWrapper
from .module import LAYER_CLASSES


class Zero2(FlatShardWrapper):
    layer_classes = LAYER_CLASSES

    def __init__(self, module, bucket_bytes=25 * 2**20, device=None):
        super().__init__(module, bucket_bytes, device)
        self.queue = BucketQueue(self.buckets)
        for b in self.buckets:
            b.grads = None  # a bucket's full grads exist only from its first grad to its send

    def bucket_grads(self, bucket):
        if bucket.grads is None:
            bucket.grads = torch.zeros(bucket.numel, dtype=self.flat_params.dtype, device=self.device)
        return bucket.grads

    def send_bucket(self, bucket):
        shard = self.shard_of(self.grad_shard, bucket)
        bucket.handle = comm.reduce_scatter(shard, self.bucket_grads(bucket), async_op=True)  # STRATEGY

    def free_bucket(self, bucket):
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle = None
            bucket.grads = None  # STRATEGY: the full grads are gone; only the 1/N shard stays

    @torch.no_grad()
    def sync_grads(self):
        for bucket in self.queue.unsent_buckets():  # params that got no grad this step
            self.send_bucket(bucket)
        for bucket in self.buckets:
            self.free_bucket(bucket)
        self.grad_shard.div_(self.world_size)  # sum -> mean

    def zero_grads(self):
        for b in self.buckets:
            b.grads = None  # buckets kept by no_sync start again from zero
