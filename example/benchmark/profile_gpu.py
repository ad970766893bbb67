"""Where a GPU step's time goes: torch.profiler over a few steady steps.

    python example/benchmark/profile_gpu.py --out DIR      # gpt2, bf16, batch 8 x 1024: under a minute on one H100

For each run (plain torch, single_device, ddp, zero3 and fsdp by default; the
runs, their loops and their data are example/benchmark/gpu.py's, world 1),
after warm-up steps (the first compiles the Triton kernels):

- ms/step: the median of the timed steps without the profiler (CUDA events);
- then --profiled steps, each alone under torch.profiler (CPU and CUDA
  activity; the device is drained before each, and the step's wall time
  runs from its start on the host to the end of its last work on either
  side). Per step, averaged over them:
  kernels launched; the GPU busy fraction (the time covered by at least one
  kernel, copy or memset, over the step's wall time: 100% means the host
  never kept the device waiting); the top 15 operators by self CPU time
  (time in the operator itself, less the operators it called), with calls
  per step; and the top 10 kernels by GPU time.

One step of each run is saved as a Chrome/Perfetto trace, DIR/<model>_<run>.json.gz
(open it in https://ui.perfetto.dev or chrome://tracing).

Without CUDA it profiles CPU activity only (tests/test_gpu_script.py runs it
with a tiny model): no kernels, and the busy fraction reads 0.
"""
import argparse
import copy
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from example.benchmark.gpu import BATCH, RUNS as GPU_RUNS, SEQ_LEN, build_run, device, print_header, step_times
from example.model import build_model

RUNS = ("torch", "single_device", "ddp", "zero3", "fsdp")
WARMUP, TIMED, PROFILED = 5, 8, 2
GPU_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}  # the categories of device work in a Kineto trace
NOT_OPERATORS = {"step", "cudaDeviceSynchronize"}  # the step's own annotation; the drain after it
TOP_OPS, TOP_KERNELS = 15, 10


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def covered(spans):
    """Microseconds covered by at least one of the (start, end) spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def step_summary(trace):
    """What one profiled step did, from its Chrome trace (a dict, as
    export_chrome_trace writes it): the step's wall time (the "step"
    annotation's start to the end of the last work, host or device), the
    host's time in step() (the annotation), the kernels, and the time the
    device was busy (us)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    step = next(e for e in events if e.get("cat") == "user_annotation" and e["name"] == "step")
    start = step["ts"]
    device_work = [e for e in events if e.get("cat") in GPU_WORK and e["ts"] + e["dur"] >= start]
    end = max([step["ts"] + step["dur"]] + [e["ts"] + e["dur"] for e in device_work])
    kernels = [e for e in device_work if e["cat"] == "kernel"]
    busy = covered([(e["ts"], e["ts"] + e["dur"]) for e in device_work])
    return {"wall_us": end - start, "host_us": step["dur"], "busy_us": busy,
            "kernels": [(e["name"], e["dur"]) for e in kernels]}


def self_cpu(profiler):
    """{operator: (self CPU us, calls)} of one profiled step."""
    return {e.key: (e.self_cpu_time_total, e.count) for e in profiler.key_averages() if e.key not in NOT_OPERATORS}


def profile_step(step, trace_path):
    """Run step() once under the profiler; returns (its trace, self CPU per operator)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    synchronize()
    with profile(activities=activities) as profiler:
        with record_function("step"):
            step()
        synchronize()
    profiler.export_chrome_trace(str(trace_path))
    return json.loads(Path(trace_path).read_text()), self_cpu(profiler)


def profile_run(model, run, base, x, y, warmup, timed, profiled, out):
    """Time and profile one run; save one step's trace under `out`; returns its summary."""
    module = copy.deepcopy(base)
    forward_backward, opt = build_run(run, module)

    def step():
        forward_backward(x, y)
        opt.step()
        opt.zero_grad()
    ms = statistics.median(step_times(step, warmup, timed))
    walls, host, busy, launches = [], [], [], []
    ops, kernels = defaultdict(lambda: [0.0, 0.0]), defaultdict(lambda: [0.0, 0.0])  # name -> [us, calls] per step
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(profiled):
            trace, operators = profile_step(step, Path(tmp) / "trace.json")
            summary = step_summary(trace)
            walls.append(summary["wall_us"])
            host.append(summary["host_us"])
            busy.append(summary["busy_us"])
            launches.append(len(summary["kernels"]))
            for name, (us, calls) in operators.items():
                ops[name][0] += us / profiled
                ops[name][1] += calls / profiled
            for name, us in summary["kernels"]:
                kernels[name][0] += us / profiled
                kernels[name][1] += 1 / profiled
        trace_file = Path(out) / f"{model}_{run}.json.gz"
        with gzip.open(trace_file, "wt") as f:
            json.dump(trace, f)
    del forward_backward, opt, module, step
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"run": run, "ms": ms, "profiled_ms": statistics.mean(walls) / 1e3,
            "busy": sum(busy) / sum(walls), "kernels": statistics.mean(launches),
            "host_ms": statistics.mean(host) / 1e3, "ops_ms": sum(us for us, _ in ops.values()) / 1e3,
            "ops": sorted(ops.items(), key=lambda kv: -kv[1][0])[:TOP_OPS],
            "top_kernels": sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS],
            "trace": str(trace_file)}


def short(name, width=90):
    return name if len(name) <= width else name[:width - 3] + "..."


def print_run(r):
    print(f"\n### {r['run']}\n")
    print(f"{r['ms']:.1f} ms/step unprofiled. Profiled: the step {r['profiled_ms']:.1f} ms, of it on the host "
          f"{r['host_ms']:.1f} ms, in operators' own time {r['ops_ms']:.1f} ms (the rest: Python between them); "
          f"{r['kernels']:.0f} kernels; GPU busy {r['busy']:.1%} of the step. Trace: {r['trace']}\n")
    print(f"| top {TOP_OPS} operators by self CPU time | ms/step | calls/step |")
    print("|---|---:|---:|")
    for name, (us, calls) in r["ops"]:
        print(f"| {short(name)} | {us / 1e3:.3f} | {calls:.0f} |")
    if not r["top_kernels"]:
        return
    print(f"\n| top {TOP_KERNELS} kernels by GPU time | ms/step | calls/step |")
    print("|---|---:|---:|")
    for name, (us, calls) in r["top_kernels"]:
        print(f"| {short(name)} | {us / 1e3:.3f} | {calls:.0f} |")


def print_summary(model, rows):
    print(f"\n## {model}: summary\n")
    print("| run | ms/step | vs torch | profiled step ms | host ms | operators' self CPU ms | kernels/step "
          "| GPU busy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['run']} | {r['ms']:.1f} | {r['ms'] / rows[0]['ms']:.2f} | {r['profiled_ms']:.1f} "
              f"| {r['host_ms']:.1f} | {r['ops_ms']:.1f} | {r['kernels']:.0f} | {r['busy']:.1%} |")


def main(out, model="gpt2", runs=RUNS, batch=BATCH, seq_len=SEQ_LEN, warmup=WARMUP, timed=TIMED,
         profiled=PROFILED):
    started = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    runs = ["torch"] + [run for run in runs if run != "torch"]  # the baseline of the ratios
    print_header()
    print(f"\n{model}, bf16, world 1, batch {batch} x {seq_len}; {warmup} warm-up steps, ms/step the median of "
          f"{timed} unprofiled steps, the rest the mean of {profiled} steps each profiled alone")
    base = build_model(model)  # fp32 on the CPU; each run takes a copy
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, base.config.vocab_size, (batch, seq_len + 1), generator=gen).to(device())
    x, y = tokens[:, :-1], tokens[:, 1:]
    rows = []
    for run in runs:
        rows.append(profile_run(model, run, base, x, y, warmup, timed, profiled, out))
        print_run(rows[-1])
        sys.stdout.flush()
    print_summary(model, rows)
    print(f"({time.perf_counter() - started:.0f} s in all)")
    if dist.is_initialized():
        dist.destroy_process_group()
    return rows


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the traces")
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--runs", nargs="+", default=RUNS, choices=GPU_RUNS, metavar="RUN",
                        help=f"runs of gpu.py (default: {' '.join(RUNS)}; torch always runs, as the baseline)")
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--timed", type=int, default=TIMED, help="unprofiled steps timed for ms/step")
    parser.add_argument("--profiled", type=int, default=PROFILED, help="steps profiled, one at a time")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    main(args.out, model=args.model, runs=args.runs, batch=args.batch_size, seq_len=args.seq_len, warmup=args.warmup,
         timed=args.timed, profiled=args.profiled)
