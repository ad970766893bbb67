"""FSDP, intra-tensor: every tensor is split 1/N across ranks.

A rank holds: for each layer, a 1/N slice of the layer's parameters,
flattened and padded (a unit; trainable and frozen parameters in separate
units), all its trainable slices in one flat buffer (local) with their
averaged grads (from the first reduce-scatter of a step to zero_grad) and
optimizer state; full parameters only while a layer uses them.
Collectives: all_gather of a layer's units before its forward and again
before its backward, the next layer's started ahead (layers.py, unshard);
reduce_scatter of each unit's grads during backward, once they are final.
The optimizer steps the slices: nothing is gathered after the step.
"""
import torch

from .. import comm
from ..comm import Buckets, LayerOrder, buckets_from_runs
from ..module import CallbackLayer
from ..strategy import Wrapper
from .layers import LAYER_CLASSES


class FSDP(Wrapper):
    layer_classes = LAYER_CLASSES

    def __init__(self, module, **options):
        super().__init__(module, **options)  # options: mixed_precision, reduce_dtype, loss_scaler, device
        layers = [m for m in self.module.modules() if isinstance(m, CallbackLayer)]
        units = layer_units(layers, self.world_size)
        unit_of = {p: u for u in units for p in u.params}
        self.units_of = {m: list(dict.fromkeys(unit_of[p] for p in m.parameters(recurse=False))) for m in layers}
        trainable = [u for u in units if u.params[0].requires_grad]
        self.slices, self.slice_start = {}, {}
        self.local = self.keep_slices(trainable)  # STRATEGY: 1/N of every tensor
        self.frozen_local = self.keep_slices([u for u in units if not u.params[0].requires_grad])
        self.buckets = Buckets(trainable[::-1], self.reduce_dtype, self.device)  # the last layer's grads first
        self.shards = self.fp32_shards([self.local]) if self.local.numel() else []
        self.order = LayerOrder()
        self.sending = []  # (unit, reduce-scatter, its averaged grads, the sum) in flight

    def keep_slices(self, units):
        """This rank's slice of each unit, in one flat buffer (self.slices[unit]
        is a view of it, starting at self.slice_start[unit]); the full tensors
        are dropped one at a time."""
        size = lambda u: u.numel // self.world_size  # noqa: E731
        local = torch.zeros(sum(size(u) for u in units), dtype=self.param_dtype, device=self.device)
        start = 0
        for unit in units:
            self.slice_start[unit], self.slices[unit] = start, local[start:start + size(unit)]
            begin = self.rank * size(unit)
            for p in unit.params:
                value = self.value(self.name_of[p], p)
                if not p.is_meta:
                    comm.broadcast(value, src=0)  # every rank starts from rank 0's weights
                offset, n = unit.offsets[p], p.numel()
                lo, hi = max(offset, begin), min(offset + n, begin + size(unit))  # p's part in this slice
                if lo < hi:
                    self.slices[unit][lo - begin:hi - begin] = value.reshape(-1)[lo - offset:hi - offset]
                self.set_data(p, self.released(p))
                del value  # one full tensor at a time
            start += size(unit)
        return local

    # ------------------------------------------------------------ gather, free

    def unshard(self, layer, training=False, backward=False):
        """Before layer computes: its units all-gathered (started ahead when the
        order predicted this layer), and the next layer's started."""
        gathers = self.in_flight.pop(layer, None)
        expected = gathers is not None
        ahead = self.order.backward(layer, expected) if backward else self.order.forward(layer, expected, training)
        gathers = gathers or self.all_gather(layer)
        if ahead is not None and ahead is not layer and ahead not in self.in_flight:
            self.in_flight[ahead] = self.all_gather(ahead)  # STRATEGY: prefetch while this layer computes
        for unit, full, handle in gathers:
            handle.wait()
            for p in unit.params:
                p.data = unit.own_view(full, p)

    def all_gather(self, layer):
        out = []
        for unit in self.units_of[layer]:
            full = torch.empty(unit.numel, dtype=self.param_dtype, device=self.device)
            out.append((unit, full, comm.all_gather(full, self.slices[unit], async_op=True)))  # STRATEGY: N slices -> full
        return out

    def reshard(self, layer):
        for unit in self.units_of[layer]:
            for p in unit.params:
                p.data = self.released(p)  # STRATEGY: free the full unit


    # ------------------------------------------------------------ grads

    @torch.no_grad()
    def reduce_scatter(self, unit):
        """Send a unit whose grads are final; then finish the one sent before it."""
        start = self.slice_start[unit]
        dest = self.shard_grads()[start:start + self.slices[unit].numel()]
        out = self.reduce_target(dest)
        handle = comm.reduce_scatter(out, unit.grads, async_op=True)  # STRATEGY: each rank gets its slice's sum
        self.sending.append((unit, handle, dest, out))
        if len(self.sending) > 1:
            self.finish(*self.sending.pop(0))

    def finish(self, unit, handle, dest, out):
        handle.wait()
        self.average_into(dest, out)
        unit.grads = None  # STRATEGY: free the unit's full grads; only this rank's slice of the sum stays

    @torch.no_grad()
    def reduce_grads(self):
        for unit in self.buckets.unsent():  # what backward did not send: parameters used no more
            self.reduce_scatter(unit)
        while self.sending:
            self.finish(*self.sending.pop(0))

    def clear_grads(self, set_to_none):
        self.drop_grads(set_to_none)

    def grad_attr(self, param):
        return self.sharded_grad(param)

    def pieces(self):
        pieces = []
        for unit, local in self.unit_slices():
            size = self.slices[unit].numel()
            pieces += self.bucket_pieces(unit, self.rank * size, size, local, self.slice_start[unit])
        return pieces

    def unit_slices(self):
        """(unit, the flat buffer its slice is in: the fp32 shard or the frozen ones), in layout order."""
        return [(u, self.shards[0] if u.params[0].requires_grad else self.frozen_local)
                for u in sorted(self.slices, key=lambda u: u.index)]

    @torch.no_grad()
    def gather_full(self):
        full = {}
        for unit, local in self.unit_slices():
            start = self.slice_start[unit]
            full.update(self.gather_bucket(unit, local[start:start + self.slices[unit].numel()].float()))
        return full

    def sync_params(self):
        pass  # the slices are updated in place; the next forward gathers them


def layer_units(layers, world_size):
    """One unit per layer for its trainable parameters and one for its frozen
    ones: the parameters it registers first (a tied parameter belongs to the
    first layer that has it), padded to N equal slices."""
    seen, runs = set(), []
    for layer in layers:
        own = [p for p in layer.parameters(recurse=False) if p not in seen]
        seen.update(own)
        runs += [run for run in ([p for p in own if p.requires_grad], [p for p in own if not p.requires_grad]) if run]
    return buckets_from_runs(runs, pad_to=world_size)
