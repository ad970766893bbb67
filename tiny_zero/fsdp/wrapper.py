"""FSDP, intra-tensor: every tensor is split 1/N across ranks.

A rank holds: for each layer, a 1/N slice of the layer's flattened, padded
parameters (unit.shard), the same slice of its grads (from its
reduce-scatter to zero_grad) and optimizer state; full parameters only while
a layer uses them.
Collectives: all_gather of each layer's unit before its forward and again
before its backward, the next layer prefetched (module.py); reduce_scatter
of each unit's grads during backward. The optimizer steps the slices: no
gather after the step.
"""
import torch
import torch.nn as nn

from .. import comm
from ..buckets import BucketedGrads, buckets_from_runs
from ..materialize import full_value, set_data
from ..module import CallbackLayer
from ..gather import GatheredWrapper, Prefetcher
from ..strategy import flat_pieces
from .layers import LAYER_CLASSES, AllGathers


class FSDP(GatheredWrapper):
    layer_classes = LAYER_CLASSES

    def __init__(self, module, **options):
        super().__init__(module, **options)  # options: mixed_precision, reduce_dtype, loss_scaler, device
        layers = [m for m in self.module.modules() if isinstance(m, CallbackLayer)]
        self.units = layer_units(layers, self.world_size)
        unit_of = {p: u for u in self.units for p in u.params}
        self.units_of = {m: list(dict.fromkeys(unit_of[p] for p in m.parameters(recurse=False))) for m in layers}
        dtype = self.named_params[0][1].dtype
        self.empty = torch.empty(0, dtype=dtype, device=self.device)
        for unit in self.units:
            self.shard_unit(unit, self.param_names(), dtype)
        self.grads = BucketedGrads(self, self.units[::-1], self.reduce_dtype, self.device)  # last layer's grads first
        self.queue = self.grads.queue
        self.prefetcher = Prefetcher(lambda layer: AllGathers(self, layer))

    def shard_unit(self, unit, name_of, dtype):
        """Keep this rank's slice of the unit; the full tensors are dropped one at a time."""
        size = unit.numel // self.world_size
        begin = self.rank * size
        unit.shard = nn.Parameter(torch.zeros(size, dtype=dtype, device=self.device))
        for p in unit.params:
            value = full_value(self.module, name_of[p], p, self.device)
            if not p.is_meta:
                comm.broadcast(value, src=0)  # every rank starts from rank 0's weights
            offset, n = unit.offsets[p], p.numel()
            lo, hi = max(offset, begin), min(offset + n, begin + size)  # overlap of p and this slice
            if lo < hi:
                unit.shard.data[lo - begin:hi - begin] = value.reshape(-1)[lo - offset:hi - offset]
            set_data(p, self.empty)

    def send_bucket(self, unit, full_grads):
        # the grad slice exists from the unit's first reduce-scatter to zero_grad
        if unit.shard not in self.grads_of:
            self.grads_of[unit.shard] = full_grads.new_empty(unit.shard.numel())  # filled by the collective
        return comm.reduce_scatter(self.grads_of[unit.shard], full_grads, async_op=True)  # STRATEGY: each rank gets its slice's sum

    def bucket_done(self, unit, full_grads):
        pass  # the full grads are freed; the slice is in grads_of[unit.shard]

    def optimizer_params(self):
        return [u.shard for u in self.units]

    def zero_grads(self):
        self.grads_of.clear()
        self.grads.clear()

    def pieces(self):
        names = self.param_names()
        return [piece for u in self.units
                for piece in flat_pieces(names, u, u.shard, self.rank * u.shard.numel())]

    @torch.no_grad()
    def gather_full(self):
        full = {}
        for unit in self.units:
            flat = torch.empty(unit.numel, dtype=torch.float32, device=self.device)
            comm.all_gather(flat, self.master(unit.shard))  # the fp32 masters
            for p in unit.params:
                full[p] = unit.own_view(flat, p).cpu().clone()
        return full


def layer_units(layers, world_size):
    """One unit per layer: the parameters it registers first (a tied parameter
    belongs to the first layer that has it), padded to N equal slices."""
    seen, runs = set(), []
    for layer in layers:
        own = [p for p in layer.parameters(recurse=False) if p not in seen]
        seen.update(own)
        if own:
            runs.append(own)
    return buckets_from_runs(runs, pad_to=world_size)
