"""DDP: data parallelism with every rank holding everything.

A rank holds: all parameters, all gradients (in one flat buffer cut into
buckets), all optimizer state.
Collectives: broadcast of rank 0's parameters at wrap time; all_reduce of each
bucket during backward (module.py); the wait, and the division by N that turns
the sum into the mean, come just before the optimizer step.
"""
import torch

from .. import comm
from ..buckets import DEFAULT_BUCKET_BYTES, BucketQueue, make_buckets
from ..strategy import Piece, Wrapper
from .layers import LAYER_CLASSES


class DDP(Wrapper):
    layer_classes = LAYER_CLASSES
    grads_sharded = False

    def __init__(self, module, bucket_bytes=DEFAULT_BUCKET_BYTES, **options):
        super().__init__(module, **options)  # options: mixed_precision, reduce_dtype, loss_scaler, device
        self.module.to(self.device)
        params = [p for _, p in self.named_params]
        for p in params:
            comm.broadcast(p.data, src=0)  # STRATEGY: every rank starts from rank 0's weights
        self.buckets = make_buckets(params[::-1], bucket_bytes)  # backward runs last layer first
        self.queue = BucketQueue(self.buckets)
        total = sum(b.numel for b in self.buckets)
        self.flat_grads = torch.zeros(total, dtype=self.reduce_dtype, device=self.device)
        self.bucket_of = self.queue.bucket_of
        self.grads_of = {p: self.grad_view(p) for p in params}  # views into the flat buffer

    def grad_view(self, p):
        return self.bucket_of[p].view(self.flat_grads, p)

    def send_bucket(self, bucket, full_grads):
        return comm.all_reduce(full_grads, async_op=True)  # STRATEGY: every rank gets the sum

    @torch.no_grad()
    def sync_grads(self):
        for bucket in self.queue.unsent_buckets():  # params that got no grad this step
            bucket.handle = self.send_bucket(bucket, bucket.range(self.flat_grads))
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()  # STRATEGY: the only wait, just before the step
                bucket.handle = None
                bucket.range(self.flat_grads).div_(self.world_size)  # sum -> mean

    def optimizer_params(self):
        return [p for _, p in self.named_params]

    def after_step(self):
        pass  # every rank made the same update: nothing to send

    def zero_grads(self):
        self.flat_grads.zero_()

    def pieces(self):
        """Every rank holds every parameter whole (checkpoints write each once)."""
        return [Piece(name, p.shape, 0, p.numel(), p, 0) for name, p in self.named_params]

    def gather_full(self):
        return {p: self.master(p).cpu().clone() for _, p in self.named_params}
