"""Worker functions for tests/test_memory.py (run on every rank): the memory
of the parameters zero3 and fsdp gather, measured with TensorMemory through
forward and backward, against what the strategy may hold at each moment: the
units of the layer computing, plus the unit gathered ahead (in flight).
Each returns a list of failures and the most bytes seen gathered."""
import math

import torch
import torch.distributed as dist

import tiny_zero
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
        unshard = model.unshard

        def measured_unshard(layer, training=False, backward=False):
            unshard(layer, training=training, backward=backward)
            held = gathered_bytes(memory, model)
            allowed = sum(unit_bytes(model, u) for u in set(model.units_of[layer]) | set(model.in_flight))
            where = "backward" if backward else "forward"
            peak[where] = max(peak[where], held)
            if held > allowed:
                failures.append(f"{name} rank {dist.get_rank()} {where} of {type(layer).__name__}: {held} bytes "
                                f"gathered, more than its units and the next in flight ({allowed})")
        model.unshard = measured_unshard
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
    tensors = [p for _, p in model.named_params] + list(tensors_in(list(model.in_flight.values())))
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
