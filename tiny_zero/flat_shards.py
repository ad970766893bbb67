"""The flat, sharded parameter layout that ZeRO-1 and ZeRO-2 share.

All parameters live in one flat buffer, bucket after bucket (gradient-ready
order). Each bucket is padded to a multiple of N and cut into N equal chunks:
rank r owns chunk r of every bucket. So a bucket's gradient is averaged with
one reduce_scatter (each rank receives the chunk it owns), and its updated
parameters come back with one all_gather.

    flat_params  [ bucket 0: r0 | r1 ][ bucket 1: r0 | r1 ] ...  (every rank)
    shard_params: the chunks of flat_params that rank r steps.

The optimizer (optimizer_params) steps `shard_params`: views into
flat_params, so in fp32 there is no second copy of the weights. Each
strategy keeps each chunk's averaged grad in grads_of.
"""
import torch
import torch.nn as nn

from . import comm
from .buckets import make_buckets
from .strategy import Wrapper, flat_pieces


class FlatShardWrapper(Wrapper):
    def __init__(self, module, bucket_bytes, **options):
        super().__init__(module, **options)
        self.module.to(self.device)
        params = [p for _, p in self.named_params]
        self.buckets = make_buckets(params[::-1], bucket_bytes, pad_to=self.world_size)
        total = sum(b.numel for b in self.buckets)
        self.flat_params = torch.zeros(total, dtype=params[0].dtype, device=self.device)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        for p in params:
            view = self.bucket_of[p].view(self.flat_params, p)
            view.copy_(p.data)
            p.data = view  # the module's parameters now live in flat_params
        comm.broadcast(self.flat_params, src=0)  # every rank starts from rank 0's weights
        self.shard_params = [nn.Parameter(b.chunk(self.flat_params, self.rank, self.world_size))
                             for b in self.buckets]

    def optimizer_params(self):
        return self.shard_params

    @torch.no_grad()
    def after_step(self):
        """After the step: every rank's updated chunks back into every rank."""
        comm.where = "the all-gather after the optimizer step"
        for b in self.buckets:
            chunk = b.chunk(self.flat_params, self.rank, self.world_size)
            b.handle = comm.all_gather(b.range(self.flat_params), chunk, async_op=True)  # STRATEGY
        for b in self.buckets:
            b.handle.wait()
            b.handle = None

    def pieces(self):
        names = self.param_names()
        size = lambda b: b.numel // self.world_size  # noqa: E731
        return [piece for b, chunk in zip(self.buckets, self.shard_params)
                for piece in flat_pieces(names, b, chunk, self.rank * size(b))]

    @torch.no_grad()
    def gather_full(self):
        full = {}
        for b, chunk in zip(self.buckets, self.shard_params):
            flat = torch.empty(b.numel, dtype=torch.float32, device=self.device)
            comm.all_gather(flat, self.master(chunk))  # the fp32 masters, not the low-precision copy
            full.update({p: b.own_view(flat, p).cpu().clone() for p in b.params})
        return full
