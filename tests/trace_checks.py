"""Worker functions for tests/test_trace.py (run on every rank): one training
step of the example's tiny GPT recorded with tiny_zero.measure.trace, next to
what comm.stats counted and what TensorMemory measured for the same step, and
the same training without the recorder."""
import torch
import torch.distributed as dist

import tiny_zero
from example.data import ByteData, load_text
from example.model import build_model
from tiny_zero import comm
from tiny_zero.measure import trace
from tiny_zero.measure.memory import TensorMemory

BUCKET_BYTES = 64 * 1024  # the tiny GPT (470 KiB) makes several buckets: some are sent while backward runs
PER_RANK, SEQ, STEPS, RECORDED = 2, 16, 4, 2  # steps 0 and 1 warm up; step 2 is recorded


def build(name):
    module = build_model("tiny", seed=0)
    if name == "single_device":
        model = tiny_zero.module.swap_layers(module)
        return model, tiny_zero.optim.AdamW(model.parameters(), lr=1e-2)
    wrapper_class, adamw_class = tiny_zero.STRATEGIES[name]
    model = wrapper_class(module, **({} if name == "fsdp" else {"bucket_bytes": BUCKET_BYTES}))
    return model, adamw_class(model, lr=1e-2)


def batch(name, step, data):
    alone = name == "single_device"  # one process with the global batch
    rank, world = (0, 1) if alone else (dist.get_rank(), dist.get_world_size())
    return data.get_batch("train", PER_RANK * (dist.get_world_size() if alone else 1), step, 0, rank, world)


def train_step(model, opt, x, y):
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def full_params(model):
    return {k: v.clone() for k, v in (model.full_state_dict() if hasattr(model, "full_state_dict")
                                      else model.state_dict()).items()}


def record(name):
    """Train STEPS steps, recording step RECORDED; also what comm.stats
    counted and TensorMemory measured over that step (its peak reset at the
    step's start), the losses and the final parameters."""
    data = ByteData(load_text(None), SEQ)
    memory = TensorMemory()
    losses = []
    with memory:
        model, opt = build(name)
        memory.attach(model, opt)
        for step in range(STEPS):
            if step != RECORDED:
                losses.append(train_step(model, opt, *batch(name, step, data)))
                continue
            calls, sent = dict(comm.stats.calls), dict(comm.stats.bytes)
            memory.reset_peak()
            recorder = trace.Recorder(model, opt, memory)
            recorder.start()
            losses.append(train_step(model, opt, *batch(name, step, data)))
            mine = recorder.stop()
            counted = {kind: (comm.stats.calls[kind] - calls.get(kind, 0), comm.stats.bytes[kind] - sent.get(kind, 0))
                       for kind in comm.stats.calls if comm.stats.calls[kind] > calls.get(kind, 0)}
            peak, breakdown = memory.peak, memory.peak_breakdown
    traces = [mine] if name == "single_device" else trace.gather(mine)
    return {"rank": dist.get_rank(), "traces": traces, "counted": counted, "peak": peak, "breakdown": breakdown,
            "losses": losses, "params": full_params(model)}


def unrecorded(name):
    """The same training, no recorder: losses and final parameters."""
    data = ByteData(load_text(None), SEQ)
    model, opt = build(name)
    losses = [train_step(model, opt, *batch(name, step, data)) for step in range(STEPS)]
    return {"losses": losses, "params": full_params(model)}
