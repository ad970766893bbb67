"""ZeRO-1: shard the optimizer state.

A rank holds: all parameters (in flat_params), all gradients (in flat_grads,
kept through backward), and optimizer state for its 1/N chunk of every bucket
(../flat_shards.py explains the layout).
Collectives: broadcast of rank 0's parameters at wrap time; after backward, one
reduce_scatter per bucket (each rank gets the averaged grads of its chunk);
after the step, one all_gather per bucket (optim.py) brings the updated
parameters back.
"""
import torch

from .. import comm
from ..flat_shards import FlatShardWrapper
from .module import LAYER_CLASSES


class Zero1(FlatShardWrapper):
    layer_classes = LAYER_CLASSES

    def __init__(self, module, bucket_bytes=25 * 2**20, device=None):
        super().__init__(module, bucket_bytes, device)
        self.flat_grads = torch.zeros_like(self.flat_params)  # full grads, same layout as params

    def send_bucket(self, bucket):
        shard = self.shard_of(self.grad_shard, bucket)
        bucket.handle = comm.reduce_scatter(shard, bucket.range(self.flat_grads), async_op=True)  # STRATEGY

    @torch.no_grad()
    def sync_grads(self):
        for bucket in self.buckets:  # all buckets, after backward
            self.send_bucket(bucket)
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.handle = None
        self.grad_shard.div_(self.world_size)  # sum -> mean

    def zero_grads(self):
        self.flat_grads.zero_()
