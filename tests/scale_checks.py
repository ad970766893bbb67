"""Worker functions for the load tests (run on every rank of a spawned world).

soak(): every strategy trains ParityNet for many steps, one after another in
the same world, while tiny_zero.measure.memory.TensorMemory counts every live tensor
storage. The steps vary as training does: most are plain, every 10th
accumulates two micro-batches under no_sync(), and every 10th is preceded
by an eval forward under no_grad. Between steps (after zero_grad) a strategy
must hold the same bytes at every step once warmed up: a gathered
parameter, a grad bucket or a collective's handle that outlives its step
would show as growth.
"""
import gc
from contextlib import nullcontext

import torch
import torch.distributed as dist

import tiny_zero
from tiny_zero.measure.memory import TensorMemory
from parity_checks import LR, PER_RANK, WD, ParityNet, global_batch, wrap

WARMUP = 20  # steps after which nothing new may be allocated for good


def soak(names, steps):
    """{name: {"bytes": live bytes after each step, "leftovers": [what was still in
    flight after a step], "model_bytes": the fp32 bytes of the whole model}}."""
    return {name: soak_one(name, steps) for name in names}


def soak_one(name, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    gc.collect()
    with TensorMemory() as memory:
        torch.manual_seed(0)
        model = wrap(name, ParityNet())
        opt = tiny_zero.STRATEGIES[name][1](model, lr=LR, weight_decay=WD)
        live, leftovers = [], []
        for step in range(steps):
            if step % 10 == 3:
                with torch.no_grad():
                    model(*local_batch(step, 9, rank, world))
            micro_batches = 2 if step % 10 == 7 else 1
            for micro in range(micro_batches):
                with model.no_sync() if micro < micro_batches - 1 else nullcontext():
                    x, y = local_batch(step, micro, rank, world)
                    loss = model(x, y) / micro_batches
                    model.backward(loss)
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            if not torch.isfinite(loss):
                raise RuntimeError(f"{name}: loss {loss.item()} at step {step}")
            del loss, x, y
            live.append(memory.current)
            leftovers += [f"step {step}: {what}" for what in in_flight(model)]
        del model, opt
        gc.collect()
    model_bytes = sum(p.numel() * 4 for p in ParityNet().parameters())
    return {"bytes": live, "leftovers": leftovers[:10], "model_bytes": model_bytes}


def local_batch(step, micro, rank, world):
    return [t[rank * PER_RANK:(rank + 1) * PER_RANK] for t in global_batch(step, micro, world)]


def in_flight(model):
    """Collectives and buffers that should not outlive a step."""
    found = []
    gathers = {**getattr(model, "prefetched", {}), **getattr(model, "gathered", {})}  # zero3, fsdp (units.Unsharding)
    if gathers:
        found.append(f"{len(gathers)} gathers still in flight or held")
    temporary = [b for b in model.buckets if model.buckets.flat is None and b.grads is not None]
    if temporary:
        found.append(f"{len(temporary)} grad buckets still allocated")
    handles = [b for b in getattr(model, "buckets", getattr(model, "units", [])) if b.handle is not None]
    if handles:
        found.append(f"{len(handles)} bucket collectives not waited for")
    return found
