"""zero3's and fsdp's units, what is gathered and freed together (find_units:
a block, by default); the order in which layers run, recorded on the first
step (GatherOrder): which unit comes next, to gather it ahead, and which the
next layer still uses; and the means of the gathers and frees (Unsharding:
units_to_gather, gather, prefetch, wait_for, unused_next, free), which
zero3's and fsdp's layers.py call in the order that is their strategy. How a
unit is gathered (zero3: broadcasts from its owners; fsdp: one all-gather of
its slices) is the strategy's too, in its wrapper.py: start_gather(unit)."""
import torch

from .agreements import agree
from .guards import released_reads
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
        self.layers = []  # the layers in the order they ran forward, recorded on the first step
        self.recording = True
        self.backward = False  # walking the order backwards: in a backward pass, recomputes included
        self.position = 0  # forward: layers done; backward: layers left (0 <= position <= len(order))
        self.last = None  # the layer that arrived last

    def arrive(self, layer, expected, backward=False, backward_follows=False):
        """`layer` is about to run (in its backward if `backward`); `expected`: what it
        needs was gathered or started ahead; `backward_follows`: a backward may follow."""
        in_backward = backward or in_backward_pass()
        if in_backward and self.recording:
            self.stop_recording()
        if self.recording or not expected:
            agree(f"the layer to gather in {'backward' if backward else 'forward'}", layer=layer.index)
        self.last = layer
        if self.recording:
            if backward_follows:  # only a forward that backward will follow sets the order
                self.layers.append(layer)
            return
        self.backward = in_backward
        if backward:
            self.step_back(layer)
        elif not in_backward:
            self.step_forward(layer)

    def stop_recording(self):
        """The first backward ends the recording; it walks back from the end."""
        self.recording = False
        self.position = len(self.layers)

    def walk_back(self):
        """A backward pass begins (its first layer's backward is about to
        run): the walk turns back from where the forward ended."""
        if self.recording:
            self.stop_recording()
        self.backward = True

    def step_forward(self, layer):
        if self.position < len(self.layers) and self.layers[self.position] is layer:
            self.position += 1
        elif layer in self.layers:
            self.position = self.layers.index(layer) + 1

    def step_back(self, layer):
        if self.position > 0 and self.layers[self.position - 1] is layer:
            self.position -= 1
        elif layer in self.layers:
            self.position = len(self.layers) - 1 - self.layers[::-1].index(layer)

    def next_layer(self):
        """The layer expected after the last one (None: the pass ends; recording: the next in module order)."""
        if self.recording:
            return self.following.get(self.last)
        if self.backward:
            return self.layers[self.position - 1] if self.position > 0 else None
        return self.layers[self.position] if self.position < len(self.layers) else None

    def next_unit(self, gathered):
        """The first unit not in `gathered` that the layers expected next need (None: none, or recording)."""
        if self.recording:
            return None
        step = -1 if self.backward else 1
        i = self.position - 1 if self.backward else self.position
        while 0 <= i < len(self.layers):
            for unit in self.units_of[self.layers[i]]:
                if unit not in gathered:
                    return unit
            i += step
        return None

    def still_needed(self):
        """The units the next layer uses: the others can be freed."""
        layer = self.next_layer()
        return self.units_of[layer] if layer is not None else ()


def find_units(module, layers, units):
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
    for layer in layers:  # a hooked module's HookedLayer: in the unit of its module
        grouped.setdefault(owner.get(getattr(layer, "module", layer), layer), []).append(layer)
    return list(grouped.items())


def held_for_pass(groups, units, params_of):
    """The units gathered from a forward's first layer to its backward's end, as
    FSDP2 keeps its root's parameters: those of frozen parameters outside
    every block (`groups`, find_units'). Code outside their layer may read
    them (DeBERTa's relative embeddings, Whisper's encoder positions) where no
    gather is, and no grad of theirs would tell (a trainable one read so
    raises: TorchGrads.refuse_grads_from_autograd)."""
    outside = {id(p) for key, layers in groups if layers == [key] for p in key.parameters(recurse=False)}
    return [u for u in units if all(id(p) in outside and not p.requires_grad for p in params_of(u))]


class Unsharding:
    """The means of zero3's and fsdp's gathers and frees, which their layers.py
    calls at its moments, in the order that is the strategy:
    units_to_gather, gather, prefetch, wait_for before a layer computes; free
    the unused_next after.
    The strategy sets self.order (a GatherOrder), and per unit
    self.unit_buffer (its buffer, memory let go while not gathered) and self.views
    ([(parameter, its view of the buffer, its released value)]), and
    starts a unit's gather with start_gather(unit) -> (buffer, [its handles])."""

    def __deepcopy__(self, memo):
        raise TypeError(f"copy.deepcopy of a {type(self).__name__}-wrapped model, or of its module (whose layers "
                        "point at the wrapper): its parameters are released between uses (zeros of their full "
                        "shape), so a copy would hold no values. For an EMA or a reference model, build the module "
                        "again and load model.full_state_dict() into it (on every rank: a collective)")

    def start_gathering(self, units_of, groups, units, params_of):
        """`groups`: find_units'; `units`: every unit; params_of(unit): its parameters."""
        held = held_for_pass(groups, units, params_of)
        self.unit_of_param = {id(p): (p, u) for u in units for p in params_of(u)}
        self.order = GatherOrder(units_of)
        self.gathered = {}  # unit -> (its buffer, [its gather's handles]), while its layers use it
        self.prefetched = {}  # unit -> the same, a gather started ahead of use
        self.held = list(held)  # gathered from a forward's first layer to its backward's end (held_for_pass)
        self.watched = set()  # the grad modes of the forwards ReleasedReads watched (guards.released_reads)

    def forward(self, *args, **kwargs):
        """held_for_pass: gathered with the forward's first layer (units_to_gather), kept where a backward may follow; ReleasedReads."""
        with released_reads(self):
            out = super().forward(*args, **kwargs)
        for unit in [u for u in self.held if u in self.gathered] if not torch.is_grad_enabled() else ():
            self.free(unit)  # no backward follows
        return out

    def units_to_gather(self, layer, backward_follows, backward):
        """The units `layer` needs, not gathered (the order notes it; an unexpected layer: the ranks agree first)."""
        missing = [u for u in self.units_of[layer] if u not in self.gathered]
        if self.held and not backward:  # held_for_pass: with the first layer, after the ranks agree on it
            missing += [u for u in self.held if u not in self.gathered and u not in missing]
        self.order.arrive(layer, all(u in self.prefetched for u in missing), backward, backward_follows)
        return missing

    def gather(self, units):
        """Each unit's gather: the one started ahead, or the strategy's start_gather now."""
        for unit in units:
            self.gathered[unit] = self.prefetched.pop(unit, None) or self.start_gather(unit)

    def prefetch(self, unit):
        """Start a unit's gather ahead of its use (None: none)."""
        if unit is not None and unit not in self.prefetched:
            self.prefetched[unit] = self.start_gather(unit)

    def wait_for(self, units):
        """The units' gathers waited for; their parameters show the gathered values."""
        for unit in units:
            for handle in self.gathered[unit][1]:
                handle.wait()  # before anything reads the buffer (on CUDA: the stream waits)
            for p, view, _ in self.views[unit]:
                p.data = view  # the view made once: the parameter shows the gathered values

    def unused_next(self):
        """The gathered units the next layer does not use (hooked modules running now and held ones stay)."""
        keep = self.order.still_needed()
        if self.running or self.held:
            keep = [*keep, *self.held, *(u for running in self.running for u in self.units_of[running])]
        return [u for u in self.gathered if u not in keep]

    def free(self, unit):
        """A unit's gathered values: released, and their memory gone (its gather
        waited for). Only what the gather filled: the parameters in views[unit]
        (zero3: those other ranks own; what this rank owns keeps its values)."""
        del self.gathered[unit]
        for p, _, released in self.views[unit]:
            p.data = released  # reading a freed buffer would read memory that is gone
        self.unit_buffer[unit].untyped_storage().resize_(0)  # the memory goes

    def free_gathered(self):
        """Nothing gathered or in flight outlives a pass (stale after a step)."""
        self.gathered.update(self.prefetched)  # gathered ahead, unused: waited for (it may write), then freed
        self.prefetched.clear()
        for unit in list(self.gathered):
            for handle in self.gathered[unit][1]:
                handle.wait()
            self.free(unit)

    def skip_to(self, layer):
        """`layer`'s backward begins where the recorded order expected others'
        first: their output reached no loss on this rank (a head in some
        ranks' loss only). Do what their backward sends on the ranks where
        it ran: gather, free, and send their buckets once their uses are
        counted done (with zeros where no grad came)."""
        order = self.order
        if not self.releases_params:
            return
        if not order.backward:  # the pass's first layer backward: the layers run last may be skipped too
            order.walk_back()
        skipped = order.next_layer()
        while skipped is not None and skipped is not layer and layer in order.layers[:order.position - 1]:
            skipped.before_layer(backward_follows=False, backward=True)  # its moments, as if its backward ran
            for bucket in self.buckets.skip(skipped.trained, send=self.require_grad_sync):
                self.send_bucket(bucket)
            skipped.after_layer()
            skipped = order.next_layer()

