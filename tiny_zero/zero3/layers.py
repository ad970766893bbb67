"""ZeRO-3 layers: gather before use, free after, send grads to their owners.

Before a layer computes (forward or backward), each of its parameters is
broadcast from the rank that owns it into temporary storage; the next layer's
broadcasts are already in flight (../gather.py). After computing, a rank
frees every parameter it does not own. Grads go into per-owner buckets and a
complete bucket is reduced to its owner at once, during backward (model.py).
"""
import torch
from .. import comm
from ..gather import GatheredLayer
from ..module import layer_classes


class Broadcasts:
    """One layer's parameters, broadcast from their owners (async)."""

    def __init__(self, zero3, layer):
        self.zero3 = zero3
        self.items = []
        for p in layer.parameters(recurse=False):
            owner = zero3.owner[p]
            full = p.data if owner == zero3.rank else torch.empty(
                zero3.full_shape[p], dtype=p.dtype, device=zero3.device)
            handle = comm.broadcast(full, src=owner, async_op=True)  # STRATEGY: owner -> everyone
            self.items.append((p, full, handle))

    def wait(self):
        for p, full, handle in self.items:
            handle.wait()
            p.data = full

    def release(self):
        for p, _, _ in self.items:
            if self.zero3.owner[p] != self.zero3.rank:
                p.data = self.zero3.empty  # STRATEGY: free what this rank does not own


class Zero3Layer(GatheredLayer):
    pass  # gather (Broadcasts), compute, release: ../gather.py


LAYER_CLASSES = layer_classes(Zero3Layer)  # Zero3Linear, Zero3LayerNorm, Zero3Embedding
