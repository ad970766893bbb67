"""ZeRO-Offload: ZeRO-2, with the optimizer in host memory.

On its device a rank holds: every trainable parameter, in one flat buffer
(flat_params, in the parameter dtype), cut into buckets, each padded to a
multiple of N and cut into N chunks; and during backward, as ZeRO-2, the
full local grads of the buckets not yet sent and finished, and this rank's
slice of the sum of each bucket in flight, until it has been copied to the
host. Nothing else outlives a backward pass: no grads, no optimizer state.
In host memory a rank holds, for its own chunk of every bucket (1/N of the
whole): the fp32 masters (shards), the averaged grads (host_grads, in the
reduce dtype), exp_avg and exp_avg_sq (the optimizer's), and under bf16 or
fp16 a copy of the masters in the parameter dtype (working), which the step
writes and the device copies back. On CUDA what a copy reads or writes is
pinned, so the copies run asynchronously. Frozen parameters stay whole on
every rank's device, never sent.
Collectives and copies: broadcast of rank 0's parameters at wrap time; one
reduce_scatter per bucket, started in backward as soon as the bucket's grads
are final (layers.py); when it is done, this rank's slice is copied to the
host, on a side stream on CUDA, while backward goes on. The step runs on the
CPU (optim.py); then each updated chunk is copied back to the device and
all_gathered (sync_params).

HostMemory, below, is what both offloads share: ZeroOffload here, and
FSDPOffload (../fsdp/wrapper.py: DeepSpeed's stage 3 with offload_optimizer).
Without a GPU the host and the device are the same memory: the code is the
same, and the copies are plain copies.
"""
import os
from contextlib import contextmanager

import torch

from .. import comm, holding
from ..buckets import DEFAULT_BUCKET_BYTES, Buckets, make_buckets
from ..holding import HeldInChunks
from ..step import Wrapper
from .layers import LAYER_CLASSES


class HostMemory:
    """What both offloads share: the optimizer's side in host memory. Grads
    land there as each collective finishes (grad_to_host), the step's scale
    and clip come there, and the copies both ways run on a side stream on
    CUDA. (`averaged`, the grads written this step, is the Wrapper's.)"""

    side_stream = None  # CUDA: the stream the copies run on (use_host)

    def use_host(self):
        """Once the device is known: the copies' stream, and this rank's share
        of the host's cores (under torchrun, which sets LOCAL_WORLD_SIZE)."""
        self.side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
        self.cores = max(1, host_cores() // local_ranks) if local_ranks else 1
        self.landing = []  # (averaged grads on the host, where this backward's average of them lands)

    # ------------------------------------------------------------ backward: grads to the host

    def grad_to_host(self, dest, average):
        """A collective's average (on the device) into dest, part of model.grads on the host."""
        # the step's first average lands in place; a later backward's is added on the host (after_backward)
        land = dest if dest.data_ptr() not in self.grads_written else self.host_empty(dest.numel(), dest.dtype)
        self.to_host(land, average)  # STRATEGY: the average to the host; backward goes on
        self.grads_written.add(dest.data_ptr())
        self.landing.append((dest, land))

    @torch.no_grad()
    def after_backward(self):
        self.finish_sends()
        self.wait_for_copies()  # the host reads the grads next
        with self.host_threads():
            for dest, land in self.landing:
                if land is not dest:
                    dest.add_(land)  # the averages add up, as p.grad does in torch
        self.landing = []

    def clip_grad_norm_(self, max_norm):
        with self.host_threads():  # the grads it reads are on the host
            return super().clip_grad_norm_(max_norm)

    def clear_grads(self, set_to_none):
        with self.host_threads():
            self.host_grads.zero_()  # zeroed, not freed: every step writes them again (the full grads: Buckets.clear)

    def where_the_step_runs(self, *values):
        """The step runs on the host: its scale and its fp16 skip (0-d device
        tensors after a clip or under fp16) come there as the grads did, by
        the side stream, with the one wait for copies a step makes anyway."""
        on_device = [v for v in values if isinstance(v, torch.Tensor) and v.device != torch.device("cpu")]
        if not on_device:
            return values
        moved = {}
        for v in on_device:
            moved[id(v)] = self.host_empty(1, v.dtype).view(())
            self.to_host(moved[id(v)], v)
        self.wait_for_copies()
        return tuple(moved.get(id(v), v) for v in values)

    # ------------------------------------------------------------ the host

    def host_masters(self, tensors):
        """The fp32 masters of these device tensors (chunks, slices), in host
        memory; under bf16/fp16 also a host copy of each in the parameter
        dtype (model.working), which the step writes and the device copies back."""
        low_precision = self.param_dtype != torch.float32
        # STRATEGY: the fp32 masters on the host (copied back from, in fp32: pinned then)
        masters = [self.host_copy(t, torch.float32, pinned=not low_precision) for t in tensors]
        if low_precision:
            self.working.update((m, self.host_copy(t, self.param_dtype, pinned=True)) for m, t in zip(masters, tensors))
        return masters

    def host_empty(self, numel, dtype, pinned=True):
        """Host memory; pinned (page-locked) where a GPU copies it, so that the copy is asynchronous."""
        return torch.empty(numel, dtype=dtype, pin_memory=pinned and self.device.type == "cuda")

    def host_copy(self, tensor, dtype, pinned):
        return self.host_empty(tensor.numel(), dtype, pinned).copy_(tensor)

    def to_host(self, host, tensor):
        """Copy a device tensor into host memory once the device has done what
        it queued for it, on the side stream, so the device goes on meanwhile."""
        if self.side_stream is None:
            host.copy_(tensor)  # no GPU: one memory, a plain copy
            return
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side_stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.side_stream)  # its memory is not reused before the copy has read it

    def to_device(self, tensor, host):
        """Copy host memory into a device tensor on the side stream; what the
        device queues next (an all_gather) waits for it."""
        if self.side_stream is None:
            tensor.copy_(host)
            return
        current = torch.cuda.current_stream(self.device)
        self.side_stream.wait_stream(current)  # the layers have done reading the old values
        with torch.cuda.stream(self.side_stream):
            tensor.copy_(host, non_blocking=True)
        current.wait_stream(self.side_stream)

    def wait_for_copies(self):
        """Block until every copy to or from the host is done: the host's
        buffers may be read and written again."""
        if self.side_stream is not None:
            self.side_stream.synchronize()

    @contextmanager
    def host_threads(self):
        """Work on the host's buffers on this rank's share of the host's cores:
        under torchrun, which starts every rank with one thread, the cores this
        process may use over the ranks on the host; else torch's own threads
        (all the cores, unless the user chose otherwise)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, self.cores))
        try:
            yield
        finally:
            torch.set_num_threads(threads)


class ZeroOffload(HostMemory, HeldInChunks, Wrapper):  # HeldInChunks: grad_attr, pieces, full_values of the chunks
    layer_classes = LAYER_CLASSES

    def __init__(self, module, bucket_bytes=DEFAULT_BUCKET_BYTES, **options):
        super().__init__(module, **options)  # options: mixed_precision, reduce_dtype, loss_scaler, device
        self.use_host()
        n = self.world_size
        buckets = make_buckets(self.trainable[::-1], bucket_bytes, pad_to=n)  # backward runs the last layer first
        self.flat_params = holding.flatten_params(self, buckets, self.trainable)
        holding.keep_whole(self, self.frozen)
        self.buckets = Buckets(buckets, self.reduce_dtype, self.device,  # a bucket's grads: from its first grad until sent
                               average_over=self.world_size)  # STRATEGY: each bucket / N, as it is flattened to be sent
        self.index_params(self.buckets)  # each trainable parameter's place in them (wrapping.py)
        chunks = [b.chunk(self.flat_params, self.rank, n) for b in buckets]  # STRATEGY: this rank steps 1/N
        self.shards = self.host_masters(chunks)
        self.host_grads = self.host_empty(self.flat_params.numel() // n, self.reduce_dtype).zero_()
        self.grads = {shard: self.host_grads[b.start // n:(b.start + b.numel) // n]
                      for shard, b in zip(self.shards, buckets)}
        self.host = self.shards + list(self.working.values()) + [self.host_grads]
        self.unfinished = []  # (bucket, reduce-scatter, its averaged grads on the host, the sum) in flight

    @torch.no_grad()
    def send_bucket(self, bucket):
        """Send a bucket whose grads are final."""
        out = torch.empty(bucket.numel // self.world_size, dtype=self.reduce_dtype, device=self.device)
        handle = comm.reduce_scatter(out, bucket.grads, async_op=True)  # STRATEGY: each rank gets its chunk's sum
        self.queue_finish(bucket, handle, self.grads[self.shards[bucket.index]], out)

    def finish(self, bucket, handle, dest, out):
        handle.wait()
        bucket.grads = None  # STRATEGY: free the bucket's full grads; only this rank's chunk of the sum stays
        self.grad_to_host(dest, out)

    # ------------------------------------------------------------ after the step: parameters to the device

    @torch.no_grad()
    def sync_params(self):
        for bucket, shard in zip(self.buckets, self.shards):
            chunk = bucket.chunk(self.flat_params, self.rank, self.world_size)
            self.to_device(chunk, self.working.get(shard, shard))  # STRATEGY: the updated chunk, in the parameter dtype
            bucket.handle = comm.all_gather(bucket.range(self.flat_params), chunk, async_op=True)  # STRATEGY
        self.wait_for_copies()  # the host's buffers are free again when this returns
        self.buckets.wait()  # STRATEGY: every rank's updated chunks, before the next forward



def host_cores():
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
