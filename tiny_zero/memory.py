"""Live tensor memory, counted exactly: the bytes of every tensor storage alive.

TensorMemory is a TorchDispatchMode. While it is active it sees the outputs of
every op (forward, backward, optimizer step, collectives). It registers each
new storage once, so a view never counts again, and subtracts the storage's
bytes when the storage is freed. Storages that existed before the mode started
count only when passed to track(). The numbers do not depend on an allocator's
caching, so on CPU they are deterministic. On CUDA, cuda_peak gives
torch.cuda.max_memory_allocated() as well.

    with TensorMemory() as memory:
        memory.track(model.parameters(), opt.state)   # what was there before
        ...                                           # train
    print(memory.peak, memory.current)                # bytes
"""
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_LIFT_FRESH = torch.ops.aten.lift_fresh.default


class TensorMemory(TorchDispatchMode):
    def __init__(self, device=None):
        """device: count only storages on this device type ("cpu", "cuda");
        None counts every device except meta."""
        super().__init__()
        self.device_type = None if device is None else torch.device(device).type
        self.current = 0  # bytes of tracked storages alive now
        self.peak = 0     # the most `current` has been since creation or reset_peak()
        self._bytes = {}  # id(storage) -> its bytes, for tracked storages alive now

    @classmethod
    def _should_skip_dynamo(cls):
        # torch wraps __torch_dispatch__ in a dynamo guard (importing dynamo, and
        # ~30 us per op) unless a mode says no. Nothing in here is compiled.
        return False

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

    def reset_peak(self):
        """Start a new peak from what is alive now (and CUDA's, if present)."""
        self.peak = self.current
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    @property
    def cuda_peak(self):
        """torch.cuda.max_memory_allocated() on the current device; None without CUDA."""
        return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None

    def _add(self, storage):
        key = id(storage)  # safe: the entry is removed before the object (and its id) goes away
        if key in self._bytes:
            return
        size = storage.nbytes()
        self._bytes[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key).atexit = False

    def _free(self, key):
        self.current -= self._bytes.pop(key)

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
