"""ZeRO-2 layers: each gradient is added into its bucket's temporary buffer;
as soon as a bucket is complete it is reduce-scattered, asynchronously, and
the bucket before it (whose reduce-scatter has had this bucket's compute to
finish) is waited for and freed.

Compare with ../zero1/module.py: the reduce-scatter moves into backward, and
full gradients no longer outlive their bucket.
"""
import torch.nn as nn

from ..module import Embedding, LayerNorm, Linear


class Zero2Layer:
    def forward_callback(self, ctx, x):
        if any(ctx.needs_input_grad):
            self.wrapper.expect_grads(self.parameters(recurse=False))
        return super().forward_callback(ctx, x)

    def accumulate_grad(self, param, grad):
        zero2 = self.wrapper
        bucket = zero2.bucket_of[param]
        bucket.own_view(zero2.bucket_grads(bucket), param).add_(grad)
        for ready in zero2.queue.grad_added(param, send=zero2.require_grad_sync):
            zero2.send_bucket(ready)  # STRATEGY: reduce-scatter now, during backward
            if ready.index > 0:
                zero2.free_bucket(zero2.buckets[ready.index - 1])  # STRATEGY: drop full grads


class Zero2Linear(Zero2Layer, Linear):
    pass


class Zero2LayerNorm(Zero2Layer, LayerNorm):
    pass


class Zero2Embedding(Zero2Layer, Embedding):
    pass


LAYER_CLASSES = {nn.Linear: Zero2Linear, nn.LayerNorm: Zero2LayerNorm, nn.Embedding: Zero2Embedding}
