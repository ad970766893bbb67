"""Worker functions for tests/test_memory.py (run on every rank): the memory
of the parameters zero3 and fsdp gather, measured with TensorMemory through
forward and backward, against what the strategy may hold at each moment: the
units of the layer computing, plus the unit gathered ahead (in flight).
gathered_memory returns a list of failures and the most bytes seen
gathered; step_counts what a step sends and swaps."""
import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

import tiny_zero
from tiny_zero import comm
from tiny_zero.measure.memory import TensorMemory
from strategy_checks import global_batch_tokens, gpt_tiny


def gathered_memory(name):
    """Every time a layer's units are gathered (forward and backward, three
    steps): the live gathered storages (TensorMemory's comm_buffers that
    parameters or gathers in flight hold) are at most the layer's units and
    the ones in flight. After forward and after backward nothing is gathered:
    forward keeps nothing full for backward."""
    torch.manual_seed(0)
    model = tiny_zero.STRATEGIES[name][0](gpt_tiny())
    opt = tiny_zero.STRATEGIES[name][1](model, lr=1e-3)
    x, y = global_batch_tokens()
    failures, peak = [], {"forward": 0, "backward": 0}
    with TensorMemory() as memory:
        memory.attach(model, opt)
        units_to_gather, wait_for, arrived = model.units_to_gather, model.wait_for, {}

        def noted(layer, backward_follows, backward):
            arrived.update(layer=layer, backward=backward)
            return units_to_gather(layer, backward_follows, backward)

        def measured_wait_for(units):  # the end of a layer's gathers (layers.py: before_layer)
            wait_for(units)
            layer, backward = arrived["layer"], arrived["backward"]
            held = gathered_bytes(memory, model)
            allowed = sum(unit_bytes(model, u) for u in set(model.units_of[layer]) | set(model.prefetched))
            where = "backward" if backward else "forward"
            peak[where] = max(peak[where], held)
            if held > allowed:
                failures.append(f"{name} rank {dist.get_rank()} {where} of {type(layer).__name__}: {held} bytes "
                                f"gathered, more than its units and the next in flight ({allowed})")
        model.units_to_gather, model.wait_for = noted, measured_wait_for
        for step in range(3):
            loss = model(x, y)
            failures += nothing_gathered(memory, model, f"{name} step {step} after forward")
            model.backward(loss)
            failures += nothing_gathered(memory, model, f"{name} step {step} after backward")
            opt.step()
            opt.zero_grad()
    largest_two = sum(sorted(unit_bytes(model, u) for u in units(model))[-2:])
    for where, most in peak.items():  # the formula: one unit gathered, plus the next in flight
        if most > largest_two:
            failures.append(f"{name} rank {dist.get_rank()}: {most} bytes gathered in {where}, more than the "
                            f"two largest units ({largest_two})")
    return failures, peak


def nothing_gathered(memory, model, when):
    held = gathered_bytes(memory, model)
    return [f"{when}: {held} bytes of parameters still gathered"] if held else []


def gathered_bytes(memory, model):
    """Bytes of the live storages that hold gathered parameters: those the
    parameters point at or a gather in flight fills, that TensorMemory counts
    as comm_buffers (a rank's own slice or owned tensor counts as parameters)."""
    category_of, live = memory.categories()
    tensors = [p for _, p in model.named_params] + list(tensors_in(list(model.prefetched.values())))
    keys = {id(t.untyped_storage()) for t in tensors}
    return sum(live[k] for k in keys if category_of.get(k) == "comm_buffers")


def tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)


def units(model):
    return {u for us in model.units_of.values() for u in us}


def unit_bytes(model, unit):
    """What gathering `unit` allocates at most on a rank: fsdp its full flat
    buffer (padded), zero3 all its tensors (an owner allocates none of its own)."""
    if hasattr(model, "unit_params"):  # zero3
        numel = sum(math.prod(model.shapes[model.name_of[p]]) for p in model.unit_params[unit])
    else:
        numel = unit.numel
    return numel * model.param_dtype.itemsize


def step_counts(name, steps=3):
    """Per step of a tiny GPT: the collectives by kind, the p.data
    assignments and the storage resizes it made; at world > 1 also what a
    gather per unit would make (per_unit_gathers), or None at world 1. The
    first step records the gather order."""
    torch.manual_seed(0)
    model = tiny_zero.STRATEGIES[name][0](gpt_tiny())
    opt = tiny_zero.STRATEGIES[name][1](model, lr=1e-3)
    x, y = global_batch_tokens()
    counts = []
    for _ in range(steps):
        comm.stats.reset()
        with counting() as seen:
            model.backward(model(x, y))
            opt.step()
            opt.zero_grad()
        counts.append(dict(calls=dict(comm.stats.calls), **seen))
    return counts, per_unit_gathers(model) if dist.get_world_size() > 1 else None


@contextmanager
def counting():
    """{"data": p.data assignments, "resizes": storage resizes} while inside."""
    seen = {"data": 0, "resizes": 0}
    data, resize = torch._C.TensorBase.data, torch.UntypedStorage.resize_

    def set_data(p, value):
        seen["data"] += 1
        data.__set__(p, value)

    def counted_resize(storage, size):
        seen["resizes"] += 1
        return resize(storage, size)
    nn.Parameter.data = property(data.__get__, set_data)
    torch.UntypedStorage.resize_ = counted_resize
    try:
        yield seen
    finally:
        del nn.Parameter.data
        torch.UntypedStorage.resize_ = resize


def per_unit_gathers(model):
    """The gathering collectives of a step, and the p.data assignments, when
    each unit is gathered once per stretch of layers that use it (along the
    recorded order in forward, back along it in backward), each of its
    parameters that this rank does not own pointed at the gathered values
    and back: zero3 broadcasts each owner's bucket and frozen tensor, fsdp
    all-gathers the unit. units: the gathers of a unit, each with a resize
    of its buffer up and one back to nothing."""
    units = gathers = assignments = 0
    for walk in (model.order.layers, model.order.layers[::-1]):
        before = ()
        for layer in walk:
            for unit in model.units_of[layer]:
                if unit not in before:
                    units += 1
                    gathers += len(model.broadcasts[unit]) if hasattr(model, "broadcasts") else 1
                    assignments += 2 * len(model.views[unit])
            before = model.units_of[layer]
    return {"units": units, "gathers": gathers, "data": assignments}
