"""One weight's life under zero3 or fsdp: each moment that touches one Linear
weight (WEIGHT below), its unit or its grad bucket, over two steps, with the
tiny_zero call chain (file:line function, outermost first) that did it.

    torchrun --nproc_per_node 2 example/lifecycle.py --strategy zero3 [fsdp]

The events are recorded by wrapping the wrapper's own methods, the layer's
moments, tiny_zero.comm's collectives and the AdamW update at run time;
tiny_zero is unchanged. "holds" names what p.data is. Rank 0 prints its
events; below one, rank 1's where it differs. Step 1 records the gather
order (nothing is prefetched in its forward); step 2 is steady.
"""
import argparse
import functools
import inspect
import itertools
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

from example.model import build_model  # noqa: E402
from tiny_zero import comm, optimizer  # noqa: E402
from tiny_zero.fsdp import FSDP, FSDPAdamW  # noqa: E402
from tiny_zero.zero3 import Zero3, Zero3AdamW  # noqa: E402

WEIGHT = "blocks.1.mlp.c_fc.weight"
STRATEGIES = {"zero3": (Zero3, Zero3AdamW), "fsdp": (FSDP, FSDPAdamW)}
METHODS = ("gather", "prefetch", "wait_for", "free", "send_bucket", "finish")
COLLECTIVES = {"broadcast": "{0} elements from rank {src}", "reduce": "{0} elements to rank {dst}",
               "all_gather": "{1} elements per rank into {0}", "reduce_scatter": "{1} elements into {0} per rank"}
PACKAGE = str(ROOT / "tiny_zero") + os.sep


def chain(method=None):
    """The last three tiny_zero frames that led here (and the method about to run), as file:line function."""
    frame, hops = sys._getframe(1), []
    while frame is not None:
        name, file = frame.f_code.co_name, frame.f_code.co_filename
        if file.startswith(PACKAGE) and not file.endswith("comm.py") and not name.startswith("<"):
            hops.insert(0, f"{file[len(PACKAGE):]}:{frame.f_lineno} {name}")
        frame = frame.f_back
    if method is not None:
        function = inspect.unwrap(getattr(method, "__func__", method))
        lines, first = inspect.getsourcelines(function)  # from its decorator: the def line is the one to name
        first += next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
        hops.append(f"{inspect.getsourcefile(function)[len(PACKAGE):]}:{first} {function.__name__}")
    return " > ".join(hops[-3:])


class Tracer:
    def __init__(self, model, name):
        self.model, self.events, self.phase, self.inside = model, [], "wrap", False
        self.p = dict(model.module.named_parameters())[name]
        self.unit, self.bucket = model.unit_of_param[id(self.p)][1], model.buckets.of[self.p]
        self.shard, self.lo, self.hi = self.shard_place()
        self.label = f"shards[{next((i for i, s in enumerate(model.shards) if s is self.shard), None)}]"
        self.name = self.unit_name(self.unit)
        layer = model.module.get_submodule(name.rsplit(".", 1)[0])
        self.originals = [(comm, kind, getattr(comm, kind)) for kind in COLLECTIVES]
        self.originals.append((optimizer, "adamw_update_", optimizer.adamw_update_))
        for owner, method in [(model, m) for m in METHODS] + [(layer, m) for m in ("before_layer", "after_layer",
                                                                                    "grad_ready")]:
            setattr(owner, method, self.traced(getattr(owner, method), getattr(self, "on_" + method)))
        for kind in COLLECTIVES:
            setattr(comm, kind, self.collective(kind, getattr(comm, kind)))
        optimizer.adamw_update_ = self.traced(optimizer.adamw_update_, self.on_adamw)

    def close(self):
        for module, name, function in self.originals:
            setattr(module, name, function)

    def traced(self, method, note):
        """method, after note(add, its arguments): True, its collectives are this weight's; a function: run after."""
        @functools.wraps(method)
        def run(*args, **kwargs):
            inside, then = self.inside, note(functools.partial(self.add, chain(method)), *args, **kwargs)
            self.inside = then is True
            try:
                out = method(*args, **kwargs)
            finally:
                self.inside = inside
            if callable(then):
                then()
            return out
        return run

    def collective(self, kind, send):
        def run(tensor, *args, **kwargs):
            if self.inside:
                sizes = [t.numel() for t in (tensor, *args[:1]) if isinstance(t, torch.Tensor)]
                self.add(chain(), f"  {kind} " + COLLECTIVES[kind].format(*sizes, **kwargs))
            return send(tensor, *args, **kwargs)
        return run

    def add(self, where, what):
        self.events.append((self.phase, what, where))
        return True

    def holds(self):
        """What p.data is now: the released placeholder, or a view of the wrapper's owned or unit_buffer."""
        with torch._C.DisableTorchFunction():  # not a read of its values: past the first forward's guard (guards.py)
            data = self.p.data
        if max(data.stride()) == 0:
            return "the released placeholder"
        for name in ("owned", "unit_buffer"):
            flat = getattr(self.model, name, None)
            flat = flat.get(self.unit) if isinstance(flat, dict) else flat
            if flat is not None and data.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                at = (data.data_ptr() - flat.data_ptr()) // data.element_size()
                return f"a view of {name}[{at}:{at + data.numel()}]"
        return "its own tensor"

    def shard_place(self):
        """(the fp32 shard with this rank's part of the weight, where in it), or (None, 0, 0)."""
        m, p = self.model, self.p
        if hasattr(m, "owned_start"):  # zero3: the owner's whole tensor, in owned's order
            start = m.owned_start.get(self.bucket, 0) + self.bucket.offsets[p]
            return (m.shards[0], start, start + p.numel()) if m.owner[p] == m.rank else (None, 0, 0)
        size = m.slices[self.unit].numel()  # fsdp: this rank's 1/N slice of the unit
        begin, offset = m.rank * size, self.unit.offsets[p]
        return m.shard_of[self.unit], max(offset, begin) - begin, min(offset + p.numel(), begin + size) - begin

    def unit_name(self, unit):
        """The unit's module path: what its parameters' names share."""
        params = unit.params if hasattr(unit, "params") else self.model.unit_params[unit]
        names = [self.model.name_of[p] for p in params]
        return os.path.commonprefix(names).rsplit(".", 1)[0] if len(names) > 1 else names[0].rsplit(".", 1)[0]

    # the notes, one per traced method
    def on_gather(self, add, units):
        if self.unit in units:
            ahead = self.unit in self.model.prefetched  # else its collectives follow, this weight's
            return add(f"gather {self.name}: " + ("started ahead (prefetched)" if ahead else
                                                  "start_gather now, not prefetched:")) and not ahead

    def on_prefetch(self, add, unit):
        if unit is self.unit and unit not in self.model.prefetched:
            return add(f"prefetch {self.name}: start_gather ahead of use:")

    def on_wait_for(self, add, units):
        if self.unit in units:
            return lambda: add(f"wait_for {self.name}: holds {self.holds()}")

    def on_free(self, add, unit):
        if unit is self.unit:
            return lambda: add(f"free {self.name}: unit_buffer's memory gone; holds {self.holds()}")

    def on_before_layer(self, add, backward_follows, backward):
        return lambda: add(f"before_layer done, the Linear computes: holds {self.holds()}")

    def on_after_layer(self, add):
        return lambda: add(f"after_layer done: holds {self.holds()}")

    def on_grad_ready(self, add, param, grad):
        if param is self.p:
            add(f"grad_ready: into bucket {self.bucket.index} ({self.bucket.numel} elements)")

    def on_send_bucket(self, add, bucket):
        if bucket is self.bucket:
            return add(f"send_bucket {bucket.index}")

    def on_finish(self, add, bucket, *_):
        if bucket is self.bucket:
            kept = f"into model.grads[{self.label}][{self.lo}:{self.hi}]" if self.shard is not None else "not kept here"
            add(f"finish bucket {bucket.index}: waited; the weight's average {kept}; bucket.grads = None")

    def on_adamw(self, add, part, *_, **__):
        same = self.shard is not None and part.untyped_storage().data_ptr() == self.shard.untyped_storage().data_ptr()
        at = (part.data_ptr() - self.shard.data_ptr()) // part.element_size() if same else 0
        if same and at < self.hi and self.lo < at + part.numel():
            add(f"AdamW steps {self.label}[{at}:{at + part.numel()}], the weight's [{self.lo}:{self.hi}]")


def trace(strategy):
    """Two steps of the tiny GPT on random tokens; rank 0 prints every rank's events."""
    wrapper, adamw = STRATEGIES[strategy]
    model = wrapper(build_model("tiny"))
    opt, tracer = adamw(model, lr=1e-3), Tracer(model, WEIGHT)
    at_wrap = f"holds {tracer.holds()}" + (f"; its part: slices[{tracer.name}][{tracer.lo}:{tracer.hi}]"
                                           if strategy == "fsdp" else "")
    steps, gen = [], torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randint(0, 256, (2, 2, 16), generator=gen)
        tracer.phase = "forward"
        loss = model(x, y)
        held = [", ".join(tracer.unit_name(u) for u in units) or "none" for units in (model.gathered, model.prefetched)]
        tracer.add(chain(wrapper.forward), "end of forward: gathered: {}; prefetched for backward: {}".format(*held))
        tracer.phase = "backward"
        loss.backward()
        tracer.phase = "step"
        opt.step()
        opt.zero_grad()
        steps.append(tracer.events)
        tracer.events = []
    tracer.close()
    everyone = [None] * model.world_size
    torch.distributed.all_gather_object(everyone, (at_wrap, steps))
    if model.rank == 0:
        print(f"== {strategy}: {WEIGHT} {tuple(tracer.p.shape)}")
        print("\n".join(f"wrap     rank {rank}: {line}" for rank, (line, _) in enumerate(everyone)))
        print(f"{'':11}at {chain(getattr(wrapper, 'keep_owned', None) or wrapper.keep_slices)}")
        for number in (1, 2):
            print(f"-- step {number}" + (" (records the gather order)" if number == 1 else " (steady)"))
            show([events[number - 1] for _, events in everyone])


def show(ranks):
    """Rank 0's events; below one, another rank's where it differs there."""
    for mine, *others in itertools.zip_longest(*ranks):
        if mine is not None:
            print(f"{mine[0]:8} {mine[1]}\n{'':11}at {mine[2]}")
        for rank, other in enumerate(others, 1):
            if other is not None and (mine is None or other[:2] != mine[:2]):
                print(f"{other[0]:8} rank {rank}: {other[1]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", nargs="+", choices=list(STRATEGIES), default=["zero3"])
    args = parser.parse_args()
    torch.distributed.init_process_group("gloo")
    for strategy in args.strategy:
        trace(strategy)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
