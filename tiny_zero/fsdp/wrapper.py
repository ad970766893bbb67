"""FSDP, intra-tensor: every tensor is split 1/N across ranks.

A unit, what is gathered and freed together (units.py), is here one flat
layout (flat_units): the trainable parameters of a transformer block (by
default; `units=` picks module classes or names; a layer outside them is one
of its own), or its frozen ones, flattened and padded; a Bucket, whose grads
are also reduce-scattered as one. A rank holds: a 1/N slice of every unit,
all its trainable slices in one flat buffer, each slice's
averaged grads (from the unit's reduce-scatter to zero_grad) and optimizer
state; a full buffer per unit, made once, whose memory exists only while the
unit's layers run, and the next unit's, gathered ahead. Each parameter has a
view of its place in that buffer, made once; it points there while its unit
is gathered, and at the shared released zero otherwise. At world 1 the slice
is the whole unit: the parameters are views of it, and nothing is gathered,
freed or sent.
Collectives: all_gather of a unit into its buffer before its first layer's
forward and again before its last layer's backward, the next unit's started
ahead (layers.py: before_layer); reduce_scatter of each unit's grads during backward, once
they are final. The optimizer steps the slices: nothing is gathered after
the step.
FSDPOffload (DeepSpeed's stage 3 with offload_optimizer): the same units,
gathers and reduce-scatters, with this rank's optimizer in host memory, as
../offload's: the fp32 masters, averaged grads and AdamW state of its slices;
each unit's averaged slice is copied there once its reduce_scatter is done,
the step runs on the CPU, and the updated slices are copied back to the
device (sync_params). With offload_params (offload_param) the slices
themselves are in host memory and nothing is copied back: before a unit's
all_gather, this rank's slice is copied into its place in the full buffer,
on the side stream that the all_gather waits for, and gathered in place
(on a GPU even at world 1: the layers cannot read host memory).
"""
import torch

from .. import comm, holding
from ..buckets import Buckets, buckets_from_runs
from ..offload.wrapper import HostMemory
from ..step import Wrapper
from ..units import Unsharding, find_units
from .layers import LAYER_CLASSES


class FSDP(Unsharding, Wrapper):
    layer_classes = LAYER_CLASSES
    params_whole_between_steps = False  # the parameters: released between uses
    fp32_shards = holding.fp32_shards  # what the optimizer steps: a hook, ../offload puts it on the host

    def __init__(self, module, units=None, **options):
        super().__init__(module, **options)  # options: mixed_precision, reduce_dtype, loss_scaler, device
        layers = self.strategy_layers  # tiny_zero's layers and the hooked modules (hooked.py)
        groups = find_units(self.module, layers, units)
        units = flat_units(groups, self.world_size)
        unit_of = {p: u for u in units for p in u.params}
        self.units_of = {m: list(dict.fromkeys(unit_of[p] for p in m.parameters(recurse=False))) for m in layers}
        self.releases_params = self.params_released_here()
        trainable = [u for u in units if u.params[0].requires_grad]
        self.slices, self.slice_start = {}, {}
        self.keep_slices(trainable)  # STRATEGY: 1/N of every tensor
        self.frozen_local = self.keep_slices([u for u in units if not u.params[0].requires_grad])
        self.buckets = Buckets(trainable[::-1], self.reduce_dtype, self.device,  # the last layer's grads first,
                               average_over=self.world_size)  # STRATEGY: each unit's / N, as it is flattened to be sent
        self.index_params(self.buckets)  # each trainable parameter's place in them (wrapping.py)
        self.shards = self.fp32_shards([self.slices[u] for u in trainable])  # one per unit: each has its own grads
        self.shard_of = dict(zip(trainable, self.shards))
        self.unit_buffer, self.views = {}, {}  # unit -> its full buffer; [(parameter, its view of it, released)]
        for unit in units if self.releases_params else ():
            self.make_buffer(unit)
        self.start_gathering(self.units_of, groups, units, lambda unit: unit.params)
        self.unfinished = []  # (unit, reduce-scatter, its averaged grads, the sum) in flight

    def keep_slices(self, units):
        """This rank's slice of each unit, in one flat buffer (self.slices[unit]
        is a view of it, starting at self.slice_start[unit]); the full tensors
        are dropped one at a time. At world 1 the slice is the unit, and each
        parameter becomes its view of it for good."""
        size = lambda u: u.numel // self.world_size  # noqa: E731
        local = self.slice_buffer(sum(size(u) for u in units))
        start = 0
        for unit in units:
            self.slice_start[unit], begin = start, self.rank * size(unit)
            self.slices[unit] = kept = local[start:start + size(unit)]
            for p in unit.params:
                value = holding.full_value(self, self.name_of[p], p)
                if not p.is_meta:
                    comm.broadcast(value, src=0)  # every rank starts from rank 0's weights
                offset, n = unit.offsets[p], p.numel()
                lo, hi = max(offset, begin), min(offset + n, begin + size(unit))  # p's part in this slice
                if lo < hi:
                    kept[lo - begin:hi - begin] = value.reshape(-1)[lo - offset:hi - offset]
                holding.set_data(self, p, holding.released(self, p) if self.releases_params else unit.own_view(kept, p))
                del value  # one full tensor at a time
            start += size(unit)
        return local

    def params_released_here(self):
        return self.world_size > 1  # world 1: every unit is whole here, its slice

    def slice_buffer(self, numel):
        """Where this rank's slices are kept: on its device (../offload: in host memory, with offload_params)."""
        return torch.zeros(numel, dtype=self.param_dtype, device=self.device)

    def make_buffer(self, unit):
        """The unit's full buffer and each parameter's view of it, made once;
        the buffer's memory is let go at once, until the unit is gathered."""
        buffer = torch.empty(unit.numel, dtype=self.param_dtype, device=self.device)
        self.views[unit] = [(p, unit.own_view(buffer, p), holding.released(self, p)) for p in unit.params]
        buffer.untyped_storage().resize_(0)
        self.unit_buffer[unit] = buffer

    # ------------------------------------------------------------ gather (when: units.Unsharding)

    def start_gather(self, unit):
        """Start a unit's all-gather into its buffer, grown back to full size."""
        buffer = self.unit_buffer[unit]
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())  # STRATEGY: memory for the full unit
        return buffer, [comm.all_gather(buffer, self.slices[unit], async_op=True)]  # STRATEGY: N slices -> the full unit

    # ------------------------------------------------------------ grads

    @torch.no_grad()
    def send_bucket(self, unit):
        """Send a unit whose grads are final. At world 1 the unit's grads are
        the sum: nothing is sent."""
        dest = self.grads_for(self.shard_of[unit])
        if self.world_size == 1:
            self.queue_finish(unit, None, dest, unit.grads)
        else:
            out = self.reduce_target(dest)
            handle = comm.reduce_scatter(out, unit.grads, async_op=True)  # STRATEGY: each rank gets its slice's sum
            self.queue_finish(unit, handle, dest, out)

    def finish(self, unit, handle, dest, out):
        if handle is not None:
            handle.wait()
        self.add_to_grads(dest, out)
        unit.grads = None  # STRATEGY: free the unit's full grads; only this rank's slice of the sum stays

    after_backward = Wrapper.finish_sends

    def sync_params(self):
        pass  # the slices are updated in place; the next forward gathers them

    # ------------------------------------------------------------ zero_grad, p.grad, state dicts (torch's conventions)

    def clear_grads(self, set_to_none):
        self.drop_grads(set_to_none)

    def grad_attr(self, param):
        return self.sharded_grad(param)

    def pieces(self):
        pieces = []
        for unit, tensor, start in self.unit_slices():
            size = self.slices[unit].numel()
            pieces += holding.bucket_pieces(self, unit, self.rank * size, size, tensor, start)
        return pieces

    def unit_slices(self):
        """(unit, the tensor its slice is in, where in it the slice starts), in
        layout order: a trainable unit's fp32 shard, or the frozen slices' buffer."""
        return [(u, self.shard_of[u], 0) if u in self.shard_of else (u, self.frozen_local, self.slice_start[u])
                for u in sorted(self.slices, key=lambda u: u.index)]

    @torch.no_grad()
    def full_values(self):
        full = {}
        for unit, tensor, at in self.unit_slices():
            full.update(holding.full_values_of_bucket(self, unit, tensor[at:at + self.slices[unit].numel()].float()))
        return full


class FSDPOffload(HostMemory, FSDP):
    """FSDP with this rank's optimizer (with offload_params, its parameter
    slices too) in host memory: FSDP's layers, gathers and reduce-scatters;
    below, where the slices, the sums and the masters are put instead."""

    def __init__(self, module, offload_params=False, units=None, **options):
        self.params_on_host = offload_params  # read by FSDP.__init__, through the hooks below
        super().__init__(module, units=units, **options)
        self.use_host()
        sizes = [shard.numel() for shard in self.shards]
        self.host_grads = self.host_empty(sum(sizes), self.reduce_dtype).zero_()  # STRATEGY: the slices' grads, on the host
        self.grads = dict(zip(self.shards, self.host_grads.split(sizes)))
        on_host = list(self.slices.values()) if self.params_on_host else []
        self.host = self.shards + list(self.working.values()) + [self.host_grads] + on_host

    def params_released_here(self):
        # on a GPU the layers cannot read host memory: a unit is brought up even at world 1
        return super().params_released_here() or (self.params_on_host and self.device.type != "cpu")

    def slice_buffer(self, numel):
        if not self.params_on_host:
            return super().slice_buffer(numel)
        return self.host_empty(numel, self.param_dtype).zero_()  # STRATEGY: the parameters' slices on the host

    def fp32_shards(self, slices):
        if self.params_on_host:  # at fp32 the host slices are the masters; else the step writes them as its copy
            return super().fp32_shards(slices)
        return self.host_masters(slices)  # STRATEGY: this rank's slices' fp32 masters, on the host

    def start_gather(self, unit):
        if not self.params_on_host:
            return super().start_gather(unit)
        buffer, size = self.unit_buffer[unit], self.slices[unit].numel()
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())  # STRATEGY: memory for the full unit
        mine = buffer[self.rank * size:(self.rank + 1) * size]
        self.to_device(mine, self.slices[unit])  # STRATEGY: this rank's slice up, queued before the all_gather
        return buffer, [comm.all_gather(buffer, mine, async_op=True)]  # STRATEGY: N slices -> the full unit, around mine

    def reduce_target(self, dest):
        return torch.empty(dest.numel(), dtype=dest.dtype, device=self.device)  # the sum, on the device

    def add_to_grads(self, dest, average):
        self.grad_to_host(dest, average)

    def free_gathered(self):
        super().free_gathered()
        self.wait_for_copies()  # the step may write the host slices: no copy of them is still reading

    @torch.no_grad()
    def sync_params(self):
        if self.params_on_host:
            return  # the step wrote the host slices themselves; the next gathers copy them up
        for unit, shard in self.shard_of.items():
            self.to_device(self.slices[unit], self.working.get(shard, shard))  # STRATEGY: the updated slice
        self.wait_for_copies()  # the host's buffers are free again when this returns


def flat_units(groups, world_size):
    """The flat layouts one all-gather brings: per group of layers (a block),
    one for its trainable parameters and one for its frozen ones, padded to N
    equal slices. A tied parameter belongs to the first group that has it."""
    seen, runs = set(), []
    for _, layers in groups:
        own = [p for layer in layers for p in layer.parameters(recurse=False) if p not in seen]
        own = list(dict.fromkeys(own))
        seen.update(own)
        runs += [run for run in ([p for p in own if p.requires_grad], [p for p in own if not p.requires_grad]) if run]
    return buckets_from_runs(runs, pad_to=world_size)
