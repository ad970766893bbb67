"""Every strategy's training step, seen: when each rank computes, which
collectives are in flight, where a rank waits, and how memory rises and
falls through forward, backward and the step.

    torchrun --nproc_per_node 2 example/benchmark/timeline.py

One process group, one run after another: single_device (on rank 0, with
the global batch), every tiny_zero strategy (tiny_zero.STRATEGIES) and
context (ring attention over all ranks, every rank given the same rows and
keeping its share of each sequence; --runs picks some), each on
the same example GPT, the same batches and the same training step as
example/<strategy>/train.py (forward, backward, clip, AdamW, zero_grad).
Buckets are --bucket-kb, so that a small model makes several of them: with
one bucket, nothing can be sent while backward still runs. Each run takes
--warmup steps, runs --repeat steps, then records --repeat more with
tiny_zero.measure.trace (what --trace does in the examples) and keeps the
fastest (the least disturbed by other load on the machine); the fastest
step of each kind says what recording costs. It writes into --out (default
docs/), with matplotlib (pip install -e ".[plot]"):

  timeline_<strategy>.png  ranks as rows, a compute and a comm lane each,
                           waits hatched red; rank 0's memory under them
  memory_over_step.png     rank 0's memory over the step, every run side
                           by side on one scale, forward/backward/step shaded

and with --traces DIR each run's Chrome/Perfetto JSON (DIR/<run>.json).
Rank 0 prints a markdown table, a row per run: the share of the time a
collective was in flight during which the rank computed (was not blocked in
a wait), the time each rank waited, and the peak of live tensor bytes with
where in the step it came.
docs/overlap.md reads the pictures.
"""
import argparse
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch
import torch.distributed as dist

import tiny_zero
from example import train_common as common
from example.data import ByteData, load_text
from example.model import CONFIGS, build_model
from tiny_zero.context import ContextParallel, ContextParallelAdamW
from tiny_zero.distributed import init_distributed, local_device
from tiny_zero.measure import draw, trace
from tiny_zero.measure.memory import TensorMemory

RUNS = ["single_device", *tiny_zero.STRATEGIES, "context"]
BUCKETED = {"ddp", "zero1", "zero2", "zero3", "offload"}  # fsdp sends one unit per layer


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=list(CONFIGS), help="model size (default: small)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank (default: 2)")
    p.add_argument("--seq-len", type=int, default=64,
                   help="tokens per sequence (default: 64: the model's state outweighs its activations)")
    p.add_argument("--bucket-kb", type=int, default=512,
                   help="gradient bucket size of ddp, zero1, zero2, zero3 and offload (default: 512)")
    p.add_argument("--warmup", type=int, default=2, help="steps first, neither timed nor recorded (default: 2)")
    p.add_argument("--repeat", type=int, default=3,
                   help="steps timed, then steps recorded; the recorded one whose slowest rank was fastest is "
                        "kept, as the least disturbed by other load (default: 3)")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=RUNS, help="which runs (default: all)")
    p.add_argument("--out", default="docs", help="where the PNGs go (default: docs)")
    p.add_argument("--traces", default=None, help="also write each run's Chrome/Perfetto JSON into this folder")
    args = p.parse_args()
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first step makes the optimizer state)")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return args


def build(name, args, device):
    """(model, optimizer) as example/<name>/train.py makes them (fp32)."""
    module = build_model(args.model, seed=0)
    groups = argparse.Namespace(weight_decay=0.1)  # the examples' default
    if name == "single_device":
        model = tiny_zero.module.swap_layers(module).to(device)
        return model, tiny_zero.optim.AdamW(common.param_groups(model, groups), lr=1e-3)
    wrapper_class, adamw_class = (ContextParallel, ContextParallelAdamW) if name == "context" else tiny_zero.STRATEGIES[name]
    options = {"bucket_bytes": args.bucket_kb * 1024} if name in BUCKETED | {"context"} else {}
    model = wrapper_class(module, device=device, **options)
    return model, adamw_class(model, common.param_groups(model.module, groups), lr=1e-3)


def train_step(model, opt, x, y):
    """The examples' step."""
    loss = model(x, y)
    loss.backward()
    if isinstance(model, tiny_zero.step.Wrapper):
        model.clip_grad_norm_(common.MAX_GRAD_NORM)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), common.MAX_GRAD_NORM)
    opt.step()
    opt.zero_grad()


def record(name, args, data, device):
    """Warm up, run --repeat steps, then record --repeat more. Returns every
    rank's record of the recorded step whose slowest rank was fastest, and
    rank 0's wall-clock seconds of the fastest step of each kind (recorded,
    not recorded)."""
    alone = name == "single_device"  # one process, the global batch
    rank, world_size = (0, 1) if alone else (dist.get_rank(), dist.get_world_size())
    rows = args.batch_size * (dist.get_world_size() if alone else 1)
    replica = (0, 1) if name == "context" else (rank, world_size)  # context: the ranks share their rows
    recorded, seconds = [], {True: [], False: []}
    gc.collect()  # the previous run's tensors go before this one is counted
    with TensorMemory() as memory:  # counting from before the model is built, as the examples do
        model, opt = build(name, args, device)
        memory.attach(model, opt)
        for step in range(args.warmup + 2 * args.repeat):
            x, y = (t.to(device) for t in data.get_batch("train", rows, step, 0, *replica))
            recording = step >= args.warmup + args.repeat
            if recording:
                recorder = trace.Recorder(model, opt, memory)
                recorder.start()
            began = now(device)
            train_step(model, opt, x, y)
            if step >= args.warmup:
                seconds[recording].append(now(device) - began)
            if recording:
                mine = recorder.stop()
                recorded.append([mine] if alone else trace.gather(mine))  # every rank gets all: they choose alike
    return min(recorded, key=lambda traces: trace.summary(traces)["step_us"]), min(seconds[True]), min(seconds[False])


def now(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def main():
    args = parse_args()
    rank, world_size = init_distributed()
    device = local_device()
    data = ByteData(load_text(None), args.seq_len)
    results = []
    for name in args.runs:
        if name == "single_device" and rank != 0:
            dist.barrier()  # rank 0 runs it alone
            continue
        traces, *seconds = record(name, args, data, device)
        if name == "single_device" and world_size > 1:
            dist.barrier()
        results.append((name, traces, seconds))
    if rank == 0:
        report(results, args)
    dist.destroy_process_group()


def report(results, args):
    print(f"--model {args.model}, {args.batch_size} x {args.seq_len} tokens per rank, buckets of {args.bucket_kb} KiB. "
          f"Of {args.repeat} recorded steps, the one whose slowest rank was fastest. Times in ms; a step's "
          f"is rank 0's wall clock, the fastest of {args.repeat} recorded and of {args.repeat} not.\n")
    print("| run | hidden under compute, of the time in flight | waited (rank 0 / 1 / ...) | step: recorded "
          "| not recorded | peak | where |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, traces, (recorded, plain) in results:
        s = trace.summary(traces)
        hidden = "none sent" if s["hidden"] is None else f"{s['hidden']:.0%} of {s['comm_us'] / 1e3:.1f}"
        waited = " / ".join(f"{w / 1e3:.1f}" for w in s["waiting_us"])
        peak = s["peak"]
        print(f"| {name} | {hidden} | {waited} | {recorded * 1e3:.1f} | {plain * 1e3:.1f} "
              f"| {peak['bytes'] / 2**20:.2f} MiB (rank {peak['rank']}) | {peak['where']} |")
        if args.traces:
            os.makedirs(args.traces, exist_ok=True)
            trace.write(os.path.join(args.traces, f"{name}.json"), traces, name)
    try:
        os.makedirs(args.out, exist_ok=True)
        for name, traces, _ in results:
            if name != "single_device":
                draw.timeline(traces, os.path.join(args.out, f"timeline_{name}.png"),
                              f"{name}: one training step on {len(traces)} ranks (--model {args.model})")
        draw.memory([(name, traces) for name, traces, _ in results], os.path.join(args.out, "memory_over_step.png"))
        print(f"\nwrote {args.out}/timeline_<strategy>.png and {args.out}/memory_over_step.png")
    except ImportError:
        print('\nno pictures: matplotlib is missing (pip install -e ".[plot]")')


if __name__ == "__main__":
    main()
