"""zero3's and fsdp's units (gather_units: a block, by default), and the
order in which layers run, recorded on the first step (GatherOrder): which
unit comes next, to gather it ahead, and which the next layer still uses."""
import torch

from .comm import agree
from .module import in_backward_pass


class GatherOrder:
    """When zero3 and fsdp gather and free their units (what one gather brings:
    a transformer block's parameters, say; `units_of` maps each layer to the
    units it uses).

    The order in which layers run forward is recorded on the first step that
    trains (a layer called twice appears twice; every rank records the same
    order). Afterwards each layer `arrive`s (forward, or walking the order
    backwards in backward); `next_unit` says which unit comes after the ones
    gathered, so the strategy can gather it ahead, and `still_needed` which
    units the coming layer uses, so it can free the others. A layer of the
    unit gathered last costs a step along the order, nothing more.

    A forward inside a backward pass is activation checkpointing's recompute
    of the layers whose backward comes next: it leaves the backward walk where
    it is, so the unit it gathers stays for that backward, and the unit
    before it is the one gathered ahead. A layer that the order does not hold
    leaves the walk where it is too.

    A layer that needs a unit the order did not predict (eval taking another
    path, a layer skipped this step, the recording step) is gathered on the
    spot; before that every rank agrees that it is the same layer, so a rank
    that really went another way gets a clear error, not mismatched collectives.
    """

    def __init__(self, units_of):
        self.units_of = units_of  # in module order
        self.following = dict(zip(units_of, list(units_of)[1:]))  # the next layer in module order
        self.order = []
        self.recording = True
        self.backward = False  # walking the order backwards: in a backward pass, recomputes included
        self.position = 0  # forward: layers done; backward: layers left (0 <= position <= len(order))
        self.last = None  # the layer that arrived last

    def arrive(self, layer, expected, backward=False, training=False):
        """`layer` is about to run (in its backward if `backward`); `expected`:
        what it needs was gathered or started ahead; `training`: a forward
        that a backward may follow."""
        in_backward = backward or in_backward_pass()
        if in_backward and self.recording:  # the first backward ends the recording; it walks back from the end
            self.recording = False
            self.position = len(self.order)
        if self.recording or not expected:
            agree(f"the layer to gather in {'backward' if backward else 'forward'}", layer=layer.index)
        self.last = layer
        if self.recording:
            if training:  # only a forward that backward will follow sets the order
                self.order.append(layer)
            return
        self.backward = in_backward
        if backward:
            self.step_back(layer)
        elif not in_backward:
            self.step_forward(layer)

    def step_forward(self, layer):
        if self.position < len(self.order) and self.order[self.position] is layer:
            self.position += 1
        elif layer in self.order:
            self.position = self.order.index(layer) + 1

    def step_back(self, layer):
        if self.position > 0 and self.order[self.position - 1] is layer:
            self.position -= 1
        elif layer in self.order:
            self.position = len(self.order) - 1 - self.order[::-1].index(layer)

    def next_layer(self):
        """The layer expected after the one that just ran (None: the pass ends).
        While recording, the guess is the next layer in module order."""
        if self.recording:
            return self.following.get(self.last)
        if self.backward:
            return self.order[self.position - 1] if self.position > 0 else None
        return self.order[self.position] if self.position < len(self.order) else None

    def next_unit(self, gathered):
        """The first unit that the layers expected next need and that is not
        in `gathered` (None: none, or recording, when nothing is predicted)."""
        if self.recording:
            return None
        step = -1 if self.backward else 1
        i = self.position - 1 if self.backward else self.position
        while 0 <= i < len(self.order):
            for unit in self.units_of[self.order[i]]:
                if unit not in gathered:
                    return unit
            i += step
        return None

    def still_needed(self):
        """The units the next layer uses: the others can be freed."""
        layer = self.next_layer()
        return self.units_of[layer] if layer is not None else ()


def gather_units(module, layers, units):
    """[(module, [its layers])]: what each gather brings. `units`: module classes
    or names (a module's path, or its class name); None: the model's repeated
    blocks, found as the children of a ModuleList that are all of one class.
    A layer in no unit is a unit of its own."""
    if units is None:
        chosen = next(([m for m in lst] for lst in module.modules()
                       if isinstance(lst, torch.nn.ModuleList) and len(lst) > 1
                       and len({type(c) for c in lst}) == 1), [])
    else:
        wanted = [u if isinstance(u, (str, type)) else type(u) for u in units]
        chosen = [m for path, m in module.named_modules()
                  if any(w == path or w == type(m).__name__ if isinstance(w, str) else isinstance(m, w)
                         for w in wanted)]
    owner = {}
    for m in chosen:
        for inner in m.modules():
            owner.setdefault(inner, m)  # the outermost chosen module holds a layer
    grouped = {}
    for layer in layers:
        grouped.setdefault(owner.get(layer, layer), []).append(layer)
    return list(grouped.items())
