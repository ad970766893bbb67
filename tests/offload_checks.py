"""Worker functions for tests/test_offload.py (run on every rank): where
ZeRO-Offload and FSDPOffload keep what, when its grads go to the host, and on how many
threads its step runs. Each returns a list of failures."""
import os

import torch
import torch.distributed as dist

import tiny_zero
from tiny_zero import explain, optimizer
from tiny_zero.config import read_config
from tiny_zero.measure.memory import TensorMemory
from tiny_zero.fsdp.optim import FSDPOffloadAdamW
from tiny_zero.fsdp.wrapper import FSDPOffload
from tiny_zero.offload.wrapper import host_cores
from parity_checks import PER_RANK, ParityNet, global_batch

OFFLOAD, OFFLOAD_ADAMW = tiny_zero.STRATEGIES["offload"]


def my_batch(step):
    rank, world = dist.get_rank(), dist.get_world_size()
    return [t[rank * PER_RANK:(rank + 1) * PER_RANK] for t in global_batch(step, 0, world)]


def train(model, opt, steps):
    for step in steps:
        model.backward(model(*[t.to(model.device) for t in my_batch(step)]))
        opt.step()


def state_on_the_host(mixed_precision):
    """After two steps: the fp32 masters, the AdamW state and the averaged grads
    are host tensors apart from the device's parameters; under bf16/fp16 the
    step also writes a host copy in the parameter dtype; on CUDA whatever a
    copy reads or writes is pinned. What stays on the device is flat_params
    (offload releases no parameter: no shared zero either): nothing else, to
    the byte."""
    failures, where = [], f"offload/{mixed_precision or 'fp32'} rank {dist.get_rank()}"
    torch.manual_seed(0)
    with TensorMemory() as memory:
        model = OFFLOAD(ParityNet(), bucket_bytes=200, mixed_precision=mixed_precision)
        opt = OFFLOAD_ADAMW(model, lr=1e-2)
        memory.attach(model, opt)
        train(model, opt, range(2))
        opt.zero_grad()
        on_device = memory.placement()["device"]
    pinned = model.device.type == "cuda"
    device_storages = {model.flat_params.untyped_storage().data_ptr()}
    low = model.param_dtype != torch.float32
    host = [("master", s, torch.float32, pinned and not low) for s in model.shards]
    host += [("moment", t, torch.float32, False) for s in opt.state.values() for k, t in s.items() if k != "step"]
    host += [("grad", g, model.reduce_dtype, pinned) for g in model.grads.values()]
    host += [("copy back", w, model.param_dtype, pinned) for w in model.working.values()]
    if len(model.working) != (len(model.shards) if low else 0):
        failures.append(f"{where}: {len(model.working)} host copies in the parameter dtype for {len(model.shards)} chunks")
    if len(host) < 4 * len(model.shards):
        failures.append(f"{where}: the optimizer has no AdamW state for every chunk: the check proves nothing")
    for what, t, dtype, must_pin in host:
        if t.device.type != "cpu" or t.dtype != dtype or t.untyped_storage().data_ptr() in device_storages:
            failures.append(f"{where}: a {what} is {t.dtype} on {t.device} (or in flat_params), not {dtype} on the host")
        if must_pin and not t.is_pinned():
            failures.append(f"{where}: a {what} is not pinned: its copy would not be asynchronous")
    if model.flat_params.device != model.device or model.flat_params.dtype != model.param_dtype:
        failures.append(f"{where}: flat_params is {model.flat_params.dtype} on {model.flat_params.device}")
    expected = model.flat_params.nbytes
    if on_device != expected:
        failures.append(f"{where}: {on_device} bytes on the device after the step, not flat_params' {expected}")
    return failures


def grads_leave_during_backward():
    """Each bucket's slice goes to the host as soon as its reduce-scatter is
    done, while backward still computes: the first copy comes before the
    last grad is added to a bucket."""
    torch.manual_seed(0)
    model = OFFLOAD(ParityNet(), bucket_bytes=200)
    opt = OFFLOAD_ADAMW(model, lr=1e-2)
    events = []
    add, to_host = model.buckets.add, model.to_host
    model.buckets.add = lambda *a, **k: events.append("grad") or add(*a, **k)
    model.to_host = lambda *a: events.append("copy") or to_host(*a)
    train(model, opt, range(1))
    copies, last_grad = events.count("copy"), len(events) - events[::-1].index("grad")
    if copies != len(model.buckets.list) or "copy" not in events[:last_grad]:
        return [f"rank {dist.get_rank()}: grads and copies came as {' '.join(events)}: "
                f"{len(model.buckets.list)} buckets, none sent during backward"]
    return []


def step_on_every_core():
    """Under torchrun (LOCAL_WORLD_SIZE set, one thread per rank) the step
    runs on this rank's share of the cores, and the thread count is restored.
    Each rank is told it is alone on its host: its share is every core (on a
    machine of one core the check cannot tell)."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    try:
        model = OFFLOAD(ParityNet(), bucket_bytes=200)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    opt = OFFLOAD_ADAMW(model, lr=1e-2)
    threads, update = [], optimizer.adamw_update_
    optimizer.adamw_update_ = lambda *a, **k: threads.append(torch.get_num_threads()) or update(*a, **k)
    try:
        train(model, opt, range(1))
    finally:
        optimizer.adamw_update_ = update
    share = host_cores()
    if not threads or set(threads) != {share} or torch.get_num_threads() != 1:
        return [f"rank {dist.get_rank()}: the step ran on {threads} threads (this rank's share: {share}), "
                f"{torch.get_num_threads()} after it (1 before)"]
    return []


def fsdp_state_on_the_host(offload_params):
    """FSDPOffload (stage 3 with offload_optimizer; offload_param too if
    offload_params), after two steps: the fp32 masters, the AdamW state and the
    averaged grads of this rank's slices are host tensors, apart from the
    device's slices; with offload_params the slices themselves are host
    memory. What stays on the device is the slices (none with
    offload_params) and the released parameters' shared zero: nothing else,
    to the byte."""
    where = f"FSDPOffload(offload_params={offload_params}) rank {dist.get_rank()}"
    failures = []
    torch.manual_seed(0)
    with TensorMemory() as memory:
        model = FSDPOffload(ParityNet(), offload_params=offload_params)
        opt = FSDPOffloadAdamW(model, lr=1e-2)
        memory.attach(model, opt)
        train(model, opt, range(2))
        opt.zero_grad()
        placement = memory.placement()
    on_device = placement["device"]
    slice_storages = {s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in model.slices.values()}
    host_storages = {t.untyped_storage().data_ptr() for t in model.host}
    pinned = model.device.type == "cuda"
    host = [("master", s, torch.float32) for s in model.shards]
    host += [("moment", t, torch.float32) for s in opt.state.values() for k, t in s.items() if k != "step"]
    host += [("grad", g, model.reduce_dtype) for g in model.grads.values()]
    if len(host) < 4 * len(model.shards) or not model.shards:
        failures.append(f"{where}: the optimizer has no AdamW state for every slice: the check proves nothing")
    for what, t, dtype in host:
        apart = offload_params or t.untyped_storage().data_ptr() not in slice_storages
        if t.device.type != "cpu" or t.dtype != dtype or not apart:
            failures.append(f"{where}: a {what} is {t.dtype} on {t.device} (or in the device's slices), "
                            f"not {dtype} on the host")
        if pinned and what != "moment" and not t.is_pinned():
            failures.append(f"{where}: a {what} is not pinned: its copy would not be asynchronous")
    if offload_params != all(p in host_storages for p in slice_storages):
        failures.append(f"{where}: the parameters' slices are {'not ' if offload_params else ''}in model.host")
    released = model.released_zero.nbytes if model.released_zero is not None else 0  # none at world 1 on CPU
    expected = (0 if offload_params else sum(slice_storages.values())) + released
    if on_device != expected:
        failures.append(f"{where}: {on_device} bytes on the device after the step, not the slices' and the "
                        f"released zero's {expected}")
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    if offload_params:
        zero["offload_param"] = {"device": "cpu"}
    settings = read_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, dist.get_world_size())
    said = "\n".join(explain.held_lines(ParityNet(), settings)[0])
    if dist.get_rank() == 0 and f"in host memory {placement['host']:,} B" not in said:  # explain tells rank 0's
        failures.append(f"{where}: {placement['host']:,} bytes in host memory, which python -m tiny_zero.explain "
                        f"does not say:\n{said}")
    return failures
