"""DDP: data parallelism, every rank holding everything.

A rank holds: every trainable parameter, in one flat buffer (flat_params);
every grad, in one flat buffer of the same layout (flat_grads), cut into
buckets; the optimizer state of all of it. p.grad is a view of flat_grads
(as torch DDP's gradient_as_bucket_view). Frozen parameters stay whole on
every rank and are never sent.
Collectives: broadcast of rank 0's parameters at wrap time; all_reduce of each
bucket during backward, as soon as its grads are final (layers.py), divided by
N first (as torch DDP: the sum of the divided grads is their average, and
cannot overflow in fp16 where the average does not); at the end of the
backward pass, the waits.
"""
import torch

from .. import comm, holding
from ..buckets import DEFAULT_BUCKET_BYTES, Buckets, make_buckets
from ..state_dicts import Piece
from ..step import Wrapper
from .layers import LAYER_CLASSES


class DDP(Wrapper):
    layer_classes = LAYER_CLASSES
    grads_replicated = True
    defer_step_agreement = True  # no collective in forward or step

    def __init__(self, module, bucket_bytes=DEFAULT_BUCKET_BYTES, **options):
        super().__init__(module, **options)  # options: mixed_precision, reduce_dtype, loss_scaler, device
        buckets = make_buckets(self.trainable[::-1], bucket_bytes)  # backward runs the last layer first
        self.flat_params = holding.flatten_params(self, buckets, self.trainable)  # STRATEGY: all of it, on every rank
        holding.keep_whole(self, self.frozen)
        self.flat_grads = torch.zeros_like(self.flat_params, dtype=self.reduce_dtype)
        self.buckets = Buckets(buckets, self.reduce_dtype, self.device, flat=self.flat_grads,
                               average_over=self.world_size)  # STRATEGY: each bucket / N, before it is sent
        self.index_params(self.buckets)  # each trainable parameter's place in them (wrapping.py)
        self.shards = holding.fp32_shards(self, [self.flat_params])
        self.grads = {self.shards[0]: self.flat_grads}

    def all_reduce(self, bucket):
        bucket.handle = comm.all_reduce(bucket.grads, async_op=True)  # STRATEGY: every rank gets the sum

    @torch.no_grad()
    def after_backward(self):
        for bucket in self.buckets.unsent():  # what backward did not send: parameters used no more
            self.all_reduce(bucket)
        # grads averaged before (no zero_grad) were the same on every rank: / N, summed, they stay
        self.buckets.wait()  # STRATEGY: the only wait, at the end of backward

    def sync_params(self):
        pass  # every rank made the same update: nothing to send

    # ------------------------------------------------------------ zero_grad, p.grad, state dicts (torch's conventions)

    def clear_grads(self, set_to_none):
        pass  # the buckets are views of flat_grads, which Buckets.clear zeroes

    def grad_attr(self, param):
        bucket = self.buckets.of[param]
        if self.reduce_dtype != param.dtype:  # p.grad must have the parameter's dtype
            return self.sharded_grad(param)
        return bucket.view(self.flat_grads, param)

    def pieces(self):
        """Every rank holds every parameter whole: the pieces are replicated."""
        pieces = []
        for name, p in self.named_params:
            if p in self.buckets.of:  # trainable when wrapped
                offset = self.buckets.of[p].start + self.buckets.of[p].offsets[p]
                pieces.append(Piece(name, p.shape, 0, p.numel(), self.shards[0], offset, True))
            else:
                pieces.append(Piece(name, p.shape, 0, p.numel(), p.data.view(-1), 0, True))
        return pieces

    @torch.no_grad()
    def full_values(self):
        return {self.module.get_parameter(piece.name): piece.tensor[piece.offset:piece.offset + piece.hi]
                .float().view(piece.shape).cpu().clone() for piece in self.pieces()}
