"""FSDP layers: all-gather the layer's flat parameters before use, free them
after, reduce-scatter the layer's grads.

Each layer's parameters form one flat unit, split 1/N across ranks. Before
a layer computes (forward or backward), one all_gather rebuilds the unit;
the next layer's is already in flight (../gather.py). After computing, the
full unit is freed: nothing full is kept between forward and backward. A
unit's grads go into one buffer that is reduce-scattered, during backward, as
soon as every parameter in it has its final grad.
"""
import torch
from .. import comm
from ..gather import GatheredLayer
from ..module import layer_classes


class AllGathers:
    """The units a layer needs (its own; a tied layer's is another's), gathered async."""

    def __init__(self, fsdp, layer):
        self.fsdp = fsdp
        self.items = []
        for unit in fsdp.units_of[layer]:
            full = torch.empty(unit.numel, dtype=unit.shard.dtype, device=fsdp.device)
            handle = comm.all_gather(full, unit.shard.detach(), async_op=True)  # STRATEGY: N slices -> full
            self.items.append((unit, full, handle))

    def wait(self):
        for unit, full, handle in self.items:
            handle.wait()
            for p in unit.params:
                p.data = unit.own_view(full, p)

    def release(self):
        for unit, _, _ in self.items:
            for p in unit.params:
                p.data = self.fsdp.empty  # STRATEGY: reshard: drop the full unit


class FSDPLayer(GatheredLayer):
    pass  # gather (AllGathers), compute, release: ../gather.py


LAYER_CLASSES = layer_classes(FSDPLayer)  # FSDPLinear, FSDPLayerNorm, FSDPEmbedding
