"""Parameters gathered around their use: what ZeRO-3 and FSDP share.

They differ only in how a layer's parameters are gathered (ZeRO-3: broadcast
from each tensor's owner; FSDP: all-gather of the layer's slices) and where
grads are sent; both plug that into the pieces here:

    GatheredLayer    gather before computing, free after, in forward and
                     again in backward; grads go to the wrapper's buckets
    GatheredWrapper  the step's end: wait for the grads, average, tidy up
    Prefetcher       the order of gathers, and the one ahead in flight

The order in which layers run forward is recorded on the first step (a layer
called twice appears twice). Afterwards, when layer k runs forward its
parameters are already in flight, and the gather of layer k+1 is started
before layer k computes; backward walks the same order in reverse. Every rank
records the same order, so every rank issues the same collectives. A layer
that arrives out of the recorded order is simply gathered on the spot.
"""
import torch

from . import comm
from .strategy import StrategyLayer, Wrapper, expects_backward


class GatheredLayer(StrategyLayer):
    def forward_callback(self, ctx, x):
        comm.where = f"{self.path} forward"  # before the gather, which may be what hangs
        params = self.wrapper.prefetcher.forward(self, expects_backward(ctx))  # next layer in flight
        out = super().forward_callback(ctx, x)
        params.release()  # STRATEGY: nothing full is kept for backward
        return out

    def backward_callback(self, ctx, grad_out):
        comm.where = f"{self.path} backward"
        params = self.wrapper.prefetcher.backward(self)  # gathered again; the layer before in flight
        grad_in = super().backward_callback(ctx, grad_out)
        params.release()
        return grad_in

    def accumulate_grad(self, param, grad):
        self.wrapper.grads.add(param, grad)  # a complete bucket is sent now (wrapper.send_bucket)


class GatheredWrapper(Wrapper):
    """Subclasses set self.grads (a BucketedGrads), self.queue and
    self.prefetcher = Prefetcher(lambda layer: <its gather of layer>)."""

    @torch.no_grad()
    def sync_grads(self):
        self.grads.finish()
        for g in self.local_grads():
            g.div_(self.world_size)  # sum -> mean
        self.prefetcher.drain()

    def after_step(self):
        pass  # the next forward gathers the updated parameters


class Prefetcher:
    def __init__(self, start_gather):
        self.start_gather = start_gather  # layer -> Gather (collectives launched, async)
        self.order = []
        self.recording = True
        self.position = 0  # forward: calls done; backward: calls left
        self.in_flight = {}  # layer -> Gather started ahead of use

    def forward(self, layer, training):
        """Before layer's forward: its params ready, the next layer's in flight.
        (Recomputation under activation checkpointing comes here too.)"""
        if self.recording:
            if training:  # only a forward that backward will follow sets the order
                self.order.append(layer)
            return self._use(layer, ahead=None)
        if self.position >= len(self.order) or self.order[self.position] is not layer:
            self.position = self.order.index(layer) if layer in self.order else len(self.order)
        self.position += 1
        ahead = self.order[self.position] if self.position < len(self.order) else None
        return self._use(layer, ahead)

    def backward(self, layer):
        """Before layer's backward: the same, walking the order in reverse."""
        if self.recording:  # the first backward ends the recording
            self.recording = False
            self.position = len(self.order)
        if self.position <= 0 or self.order[self.position - 1] is not layer:
            self.position = len(self.order) - self.order[::-1].index(layer) if layer in self.order else 0
        self.position -= 1
        ahead = self.order[self.position - 1] if self.position > 0 else None
        return self._use(layer, ahead)

    def _use(self, layer, ahead):
        gather = self.in_flight.pop(layer, None) or self.start_gather(layer)
        if ahead is not None and ahead not in self.in_flight and ahead is not layer:
            self.in_flight[ahead] = self.start_gather(ahead)  # STRATEGY: prefetch while this layer computes
        gather.wait()
        return gather

    def drain(self):
        """Finish gathers that were started but never used (end of a step)."""
        for gather in self.in_flight.values():
            gather.wait()
            gather.release()
        self.in_flight.clear()
