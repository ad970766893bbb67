"""Live tensor memory, counted exactly: the bytes of every tensor storage alive,
and at the peak, what they were.

TensorMemory is a TorchDispatchMode. While it is active it sees the outputs of
every op (forward, backward, optimizer step, collectives). It registers each
new storage once, so a view never counts again, and subtracts the storage's
bytes when the storage is freed. A storage resized in place (resize_, which
no op shows: zero3's and fsdp's unit buffers, FSDP2's) counts what it holds
after the resize. Storages that existed before the mode started count only
when passed to track() or grown by a resize. The numbers do not depend on an allocator's
caching, so on CPU they are deterministic. On CUDA, cuda_peak and
cuda_reserved_peak give torch.cuda.max_memory_allocated() and
max_memory_reserved() as well.

    with TensorMemory() as memory:
        memory.track(model.parameters(), opt.state)   # what was there before
        memory.attach(model, opt)                     # optional: the breakdown
        ...                                           # train
    print(memory.peak, memory.current)                # bytes
    print(memory.peak_breakdown)                      # {category: bytes} at the peak
    print(memory.placement(), memory.peak_placement)  # {"device": bytes, "host": bytes}

The breakdown sorts each live storage into one of CATEGORIES by identity,
against what the model and optimizer hold at that moment (held_tensors()):

    parameters       what the optimizer steps: all parameters (ddp, single
                     device), flat_params (zero1/2: the shards are views of
                     it; offload: its chunks are copied back into it), the
                     owned tensors (zero3), the unit slices (fsdp)
    optimizer_state  exp_avg, exp_avg_sq, step, and the fp32 masters under
                     mixed precision (offload: always, on the host)
    gradients        the grads the optimizer will read (model.grads, p.grad):
                     ddp and zero1: the full flat_grads; zero2: grad_chunks;
                     zero3: the owned grads; fsdp: the grads of its slices;
                     offload: host_grads
    comm_buffers     what exists only to be communicated: full-grad buckets
                     being filled or in flight (zero2/3, fsdp, offload),
                     parameters gathered for the layer computing and the one
                     prefetched (zero3, fsdp), the host's copies of the
                     chunks in the parameter dtype, for the copy back (offload)
    activations      storages that autograd saved for backward (seen through
                     saved-tensor hooks while the mode is active)
    other            everything else: the batch, logits and loss, gradients
                     of activations, temporaries of the optimizer step

The first category that names a storage wins. After the peak rises, the
breakdown is taken at the last moment the same storages are alive: just
before the next allocation or free (or when peak_breakdown is read). So it
sums to peak, and the code that made the peak's newest tensor has usually
stored it by then. What is approximate: a tensor not yet stored where
held_tensors() looks counts as `other` (a gather whose layer has more
parameters still to allocate, say); tensors saved under activation
checkpointing's own hooks count as `other`, not `activations`. For the
example GPTs the peak is reached early in backward (the logits' grad, or a
LayerNorm's backward temporary), with every activation still saved.

placement() splits the same bytes by where they live: "host" is what an
offloading wrapper keeps in host memory (ZeroOffload: model.host and its
optimizer's state), "device" all the rest. On CUDA that is also a split by
device type; on a machine without a GPU, where host and device are one
memory, it says which would be which. Temporaries of the step on the host
have no name to be known by: they count as device.
"""
import time
import weakref
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..guards import ShardedGrad

_LIFT_FRESH = torch.ops.aten.lift_fresh.default

CATEGORIES = ("parameters", "gradients", "optimizer_state", "comm_buffers", "activations", "other")


class TensorMemory(TorchDispatchMode):
    def __init__(self, device=None):
        """device: count only storages on this device type ("cpu", "cuda");
        None counts every device except meta."""
        super().__init__()
        self.device_type = None if device is None else torch.device(device).type
        self.current = 0  # bytes of tracked storages alive now
        self.peak = 0     # the most `current` has been since creation or reset_peak()
        self._peak_breakdown = None
        self._peak_host = None
        self._pending = False  # the peak rose and its breakdown is still to be taken
        self._bytes = {}  # id(storage) -> its bytes, for tracked storages alive now
        self._saved = Counter()  # id(storage) -> tensors autograd holds for backward
        self._holders = None  # (model, optimizer), from attach()
        self._hooks = None
        # f(key, delta), told of each change just before it: key = id(storage),
        # delta its bytes, negative when it is freed (tiny_zero.measure.trace)
        self.listeners = []

    @classmethod
    def _should_skip_dynamo(cls):
        # torch wraps __torch_dispatch__ in a dynamo guard (importing dynamo, and
        # ~30 us per op) unless a mode says no. Nothing in here is compiled.
        return False

    def __enter__(self):
        # See what autograd saves for backward (to tell activations apart). The
        # hooks change nothing else; where they are disabled, do without.
        try:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._hooks.__enter__()
        except RuntimeError:
            self._hooks = None
        self._unpatched_resize = self._see_resizes()
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._unpatched_resize
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        return result

    def _see_resizes(self):
        """A storage resized in place (zero3's and fsdp's gathered units,
        FSDP2's, freed by resize_(0) and grown again) runs no op that this
        mode sees: UntypedStorage.resize_ tells it instead, while the mode is
        active, as torch's MemTracker does. Returns the resize_ it wraps."""
        unpatched = torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = unpatched(storage, size)
            self._resized(storage)
            return out
        torch.UntypedStorage.resize_ = resize_
        return unpatched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # An output sharing an input's storage (a view, an in-place op, a
        # collective writing into its argument) allocated nothing new. The
        # exception: torch.tensor(data) makes a tensor and passes it through
        # lift_fresh, whose input is therefore new too.
        inputs = set() if func is _LIFT_FRESH else {id(s) for s in self._storages((args, kwargs))}
        for s in self._storages(out):
            if id(s) not in inputs:
                self._add(s)
        return out

    def track(self, *objects):
        """Count storages that already exist: tensors, or dicts, lists, tuples
        and iterators of them, nested (a module's parameters(), an
        optimizer's state). Each storage is counted once however often it is
        passed."""
        for s in self._storages(objects):
            self._add(s)

    def attach(self, model, optimizer=None):
        """From now on record peak_breakdown, classifying storages against
        what `model` (a tiny_zero wrapper or a plain module) and `optimizer`
        hold. The peak restarts from now, like reset_peak()."""
        self._holders = (model, optimizer)
        self.reset_peak()

    def settle(self, quiet=0.05, most=2.0):
        """Wait (at most `most` seconds) until the count holds still for `quiet`
        seconds: a finished collective's buffer is freed when gloo's thread
        lets go of it, which can come a moment after its wait returned."""
        deadline, last, since = time.monotonic() + most, self.current, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.01)
            if self.current != last:
                last, since = self.current, time.monotonic()
            elif time.monotonic() - since >= quiet:
                break
        return self.current

    def breakdown(self):
        """{category: bytes} of the storages alive now (see the module docstring)."""
        return self._classify()[0]

    def categories(self):
        """{id(storage): category} of the storages alive now, and their bytes:
        ({key: category}, {key: bytes})."""
        category_of = {}
        if self._holders is not None:
            for category, tensors in held_tensors(*self._holders).items():
                for s in self._storages(tensors):
                    category_of.setdefault(id(s), category)
        # a copy (the garbage collector may free storages meanwhile), without
        # those resized to nothing: to the listeners they were freed
        live = {key: size for key, size in list(self._bytes.items()) if size}
        return {key: category_of.get(key) or ("activations" if self._saved[key] else "other") for key in live}, live

    def placement(self):
        """{"device": bytes, "host": bytes} of the storages alive now; sums to current."""
        host = self._classify()[1]
        return {"device": self.current - host, "host": host}

    def _classify(self):
        """({category: bytes}, bytes held on the host) of the storages alive
        now. Used inside, so a subclass may redefine breakdown()."""
        out = dict.fromkeys(CATEGORIES, 0)
        category_of, live = self.categories()
        for key, size in live.items():
            out[category_of[key]] += size
        host = {id(s) for s in self._storages(host_tensors(*self._holders))} if self._holders is not None else set()
        return out, sum(size for key, size in live.items() if key in host)

    @property
    def peak_breakdown(self):
        """{category: bytes} at the peak (None before attach()); sums to peak."""
        self._settle()
        return self._peak_breakdown

    @property
    def peak_placement(self):
        """{"device": bytes, "host": bytes} at the peak (None before attach()); sums to peak."""
        self._settle()
        if self._peak_host is None:
            return None
        return {"device": self.peak - self._peak_host, "host": self._peak_host}

    def reset_peak(self):
        """Start a new peak from what is alive now (and CUDA's, if present)."""
        self.peak = self.current
        self._pending = False
        if self._holders is not None:
            self._peak_breakdown, self._peak_host = self._classify()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    @property
    def cuda_peak(self):
        """torch.cuda.max_memory_allocated() on the current device; None without CUDA."""
        return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None

    @property
    def cuda_reserved_peak(self):
        """torch.cuda.max_memory_reserved() on the current device (what the caching
        allocator took from the GPU); None without CUDA."""
        return torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None

    def _add(self, storage):
        key = id(storage)  # safe: the entry is removed before the object (and its id) goes away
        if key in self._bytes:
            return
        self._settle()
        size = storage.nbytes()
        for listener in self.listeners:
            listener(key, size)
        self._bytes[key] = size
        self.current += size
        weakref.finalize(storage, self._free, key).atexit = False
        if self.current > self.peak:
            self.peak = self.current
            self._pending = self._holders is not None

    def _resized(self, storage):
        """After storage.resize_: its bytes are what it holds now. To the
        listeners a resize is a free of the old bytes and an allocation of
        the new. A storage not counted yet counts from its first growth."""
        if storage.device.type == "meta" or self.device_type not in (None, storage.device.type):
            return
        key, size = id(storage), storage.nbytes()
        if key not in self._bytes:
            if size:
                self._add(storage)
            return
        before = self._bytes[key]
        if size == before:
            return
        self._settle()
        for listener in self.listeners:
            if before:
                listener(key, -before)
            if size:
                listener(key, size)
        self._bytes[key] = size
        self.current += size - before
        self._new_peak()

    def _new_peak(self):
        """The count grew: a new peak? (PeerMemory extends it.)"""
        if self.current > self.peak:
            self.peak = self.current
            self._pending = self._holders is not None

    def _free(self, key):
        if not self._bytes[key]:  # resized to nothing: freed then
            del self._bytes[key]
            return
        self._settle()
        for listener in self.listeners:
            listener(key, -self._bytes[key])
        self.current -= self._bytes.pop(key)

    def _settle(self):
        """Take the pending peak's breakdown: called just before the live
        storages change, so the code that allocated the peak's last storage
        has had every chance to store it where held_tensors() finds it."""
        if self._pending:
            self._pending = False
            self._peak_breakdown, self._peak_host = self._classify()

    def _pack(self, tensor):
        """Saved-tensor hook: note that autograd holds this storage until the
        alias it stores instead of the tensor goes away."""
        alias = tensor.detach()  # no reference back to the graph, the same storage
        for s in self._storages(alias):
            key = id(s)
            if key in self._bytes:
                self._saved[key] += 1
                weakref.finalize(alias, self._unsave, key).atexit = False
        return alias

    def _unsave(self, key):
        self._saved[key] -= 1
        if not self._saved[key]:
            del self._saved[key]

    def _storages(self, obj):
        """Every countable storage in a (nested) structure of tensors."""
        if isinstance(obj, torch.Tensor):
            if obj.layout == torch.strided and obj.device.type != "meta" and (
                    self.device_type is None or obj.device.type == self.device_type):
                yield obj.untyped_storage()
        elif isinstance(obj, dict):
            for value in obj.values():
                yield from self._storages(value)
        elif isinstance(obj, (list, tuple, set, Iterator)):
            for item in obj:
                yield from self._storages(item)


def _unpack(alias):
    return alias


def held_tensors(model, optimizer=None):
    """What `model` and `optimizer` hold now, by category, in the order the
    breakdown tries them: {category: tensors (nested lists and dicts)}.
    `model` is a tiny_zero wrapper (it says what it holds: Wrapper.held) or a
    plain module."""
    state = list(optimizer.state.values()) if optimizer is not None else []
    if hasattr(model, "expert_params"):  # tiny_zero.experts: this rank's experts, whole, beside the wrapper's
        held = wrapper_held(model, state + list(optimizer.expert_adamw.state.values()) if optimizer else state)
        experts = model.expert_params()
        held["parameters"] += experts
        held["gradients"] += [p.grad for p in experts if p.grad is not None]
        return held
    if hasattr(model, "shards"):
        return wrapper_held(model, state)
    params = list(model.parameters())
    return {"parameters": params, "optimizer_state": state, "gradients": [p.grad for p in params],
            "comm_buffers": []}


def wrapper_held(model, optimizer_state):
    """What a tiny_zero wrapper holds, from what every strategy declares
    (shards, working, grads, buckets, released_zero, host; zero3's and
    fsdp's gather buffers, unit_buffer). fp32 masters count as optimizer state, as the ZeRO paper
    counts them: on the host they are the pieces' tensors (offload)."""
    host = {id(t) for t in model.host}
    stored = {id(piece.tensor): piece.tensor for piece in model.state_dicts.all_pieces()}.values()
    masters = list(model.working) + [t for t in stored if id(t) in host]
    grads = [p.grad for _, p in model.named_params if p.grad is not None and not isinstance(p.grad, ShardedGrad)]
    buckets = model.buckets
    temporary = [b.grads for b in buckets if buckets.flat is None and b.grads is not None]
    temporary += [part for b in buckets for part in b.parts.values()]
    # zero3's and fsdp's gather buffers (model.unit_buffer: empty while not gathered), counted from the
    # moment a gather grows one, before the gather is stored (prefetched, gathered)
    gathered = list(getattr(model, "unit_buffer", {}).values())
    return {"parameters": [model.working.get(t, t) for t in stored if id(t) not in host]
            + [getattr(model, "flat_params", None), model.released_zero],
            "optimizer_state": optimizer_state + masters,
            "gradients": list(model.grads.values()) + grads + [buckets.flat],
            "comm_buffers": temporary + gathered + [p for _, p in model.named_params] + model.host}


def host_tensors(model, optimizer=None):
    """What `model` keeps in host memory, off its device: an offloading
    wrapper's model.host and its optimizer's state; nothing for the others."""
    if not getattr(model, "host", None):
        return []
    return model.host + (list(optimizer.state.values()) if optimizer is not None else [])
