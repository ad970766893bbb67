"""tiny_zero's pipeline next to torch.distributed.pipelining, and its bubble.

    torchrun --nproc_per_node 2 example/benchmark/pipeline.py --model small --repeat 5
    torchrun --nproc_per_node 4 example/benchmark/pipeline.py --bubble

The example GPT as an nn.Sequential (example/model.py: GPTSequential), one
stage per rank, cut where tiny_zero's balance by parameter count cuts it,
the same batch for every run.

Default: tiny_zero's Pipeline with GPipe and with 1F1B against
torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B on the same
stages (plain torch modules), one run after another, in turn, --repeat
times. Time: a training step (forward and backward of every micro-batch;
no optimizer step), each step's time its slowest rank's, the median over
--steps, the best repeat (other load only ever adds time). Memory: the peak
live tensor bytes of each stage over one step (tiny_zero.measure.memory).
torch's pipelining does not tie wte and the head across stages: its last
stage holds a copy of wte whose grad stays there; tiny_zero sends that grad
to stage 0, which steps the one parameter (a little more traffic, in its time).

--bubble: tiny_zero's pipeline alone, for each M in --microbatches, with a
micro-batch of --rows sequences: each stage's idle fraction, the time it
waits on receives and, at the end, for the other stages (the loss's
all-reduce), over the step's time, next to (S - 1)/(M + S - 1).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from example.model import CONFIGS, build_sequential, loss_fn
from tiny_zero.distributed import init_distributed, local_device
from tiny_zero.measure.memory import TensorMemory
from tiny_zero.pipeline import Pipeline
from tiny_zero.pipeline.schedule import bubble

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=list(CONFIGS), help="model size (default: small)")
    p.add_argument("--rows", type=int, default=4, help="sequences per micro-batch (default: 4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--microbatches", type=int, nargs="+", default=None,
                   help="micro-batches per step (default: 4; with --bubble, 1 4 8)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default: 10)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each, in turn (default: 3)")
    p.add_argument("--bubble", action="store_true", help="measure tiny_zero's idle fraction per stage instead")
    return p.parse_args()


def batch(args, microbatches):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIGS[args.model].vocab_size, (args.rows * microbatches, args.seq_len + 1), generator=g)
    return tokens[:, :-1].to(local_device()), tokens[:, 1:].to(local_device())


def tiny_zero_step(args, schedule, microbatches):
    """A function that runs one training step of tiny_zero's pipeline, and the pipeline."""
    pipe = Pipeline(build_sequential(args.model, device="meta"), loss_fn, microbatches=microbatches,
                    schedule=schedule)
    x, y = batch(args, microbatches)

    def step():
        pipe.train_step(x, y)
        pipe.zero_grad()
    return step, pipe


def torch_step(args, schedule, microbatches, cut):
    """The same with torch.distributed.pipelining, on the stage tiny_zero's pipeline cut."""
    torch.manual_seed(0)
    module = nn.Sequential(*list(build_sequential(args.model))[cut[0]:cut[1]]).to(local_device())
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(module, rank, world, local_device())
    pipe = TORCH_SCHEDULES[schedule](stage, n_microbatches=microbatches, loss_fn=loss_fn)
    x, y = batch(args, microbatches)

    def step():
        if rank == 0:
            pipe.step(x)
        elif rank == world - 1:
            pipe.step(target=y, losses=[])
        else:
            pipe.step()
        module.zero_grad(set_to_none=True)
    return step


def seconds(step, steps):
    """The median step time over `steps`, each step's the slowest rank's."""
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def peak_bytes(step):
    """Each rank's peak live tensor bytes over one step (after a first one)."""
    step()
    with TensorMemory() as memory:
        step()
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, memory.peak)
    return peaks


def compare(args):
    microbatches = (args.microbatches or [4])[0]
    steps = {}
    for schedule in TORCH_SCHEDULES:
        steps[f"tiny_zero {schedule}"], pipe = tiny_zero_step(args, schedule, microbatches)
        begin = list(pipe.module).index(pipe.layers[0])  # where tiny_zero cut this rank's stage
        steps[f"torch {schedule}"] = torch_step(args, schedule, microbatches, (begin, begin + len(pipe.layers)))
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(args.repeat):
        for name, step in steps.items():
            step()  # warm-up
            best[name] = min(best[name], seconds(step, args.steps))
    peaks = {name: peak_bytes(step) for name, step in steps.items()}
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"{args.model}, {world} stages, {microbatches} micro-batches of {args.rows} x {args.seq_len} tokens, "
              f"{torch.get_num_threads()} threads per rank, best of {args.repeat} repeats of {args.steps} steps")
        print("| run | step (ms) | x torch's | " + " | ".join(f"peak, stage {s}" for s in range(world)) + " |")
        print("|---|---:|---:|" + "---:|" * world)
        for name in steps:
            ratio = best[name] / best["torch " + name.split()[1]]
            cells = " | ".join(f"{p / 2**20:.2f} MiB" for p in peaks[name])
            print(f"| {name} | {best[name] * 1e3:.1f} | {ratio:.2f} | {cells} |")


def idle_fractions(args):
    """tiny_zero's pipeline: each stage's idle fraction of a step, for each M."""
    world = dist.get_world_size()
    rows = []
    for microbatches in args.microbatches or [1, 4, 8]:
        for schedule in TORCH_SCHEDULES:
            step, pipe = tiny_zero_step(args, schedule, microbatches)
            waited = [0.0]
            for name in ("exchange", "mean_loss"):  # the receives, and the end: waiting for the other stages
                setattr(pipe, name, timed(getattr(pipe, name), waited))
            step()  # warm-up
            best = None
            for _ in range(args.repeat):
                waited[0] = 0.0
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                fraction = torch.tensor([waited[0] / (time.perf_counter() - start)])
                everyone = [torch.zeros(1) for _ in range(world)]
                dist.all_gather(everyone, fraction)
                measured = [f.item() for f in everyone]
                best = measured if best is None or sum(measured) < sum(best) else best
            rows.append((world, microbatches, schedule, best))
    if dist.get_rank() == 0:
        print(f"{args.model}, micro-batches of {args.rows} x {args.seq_len} tokens, {torch.get_num_threads()} "
              f"threads per rank; idle fraction per stage, the best of {args.repeat} runs of {args.steps} steps")
        print("| S | M | (S-1)/(M+S-1) | schedule | " + " | ".join(f"stage {s}" for s in range(world)) + " |")
        print("|---|---|---:|---|" + "---:|" * world)
        for s, m, schedule, measured in rows:
            cells = " | ".join(f"{f:.2f}" for f in measured)
            print(f"| {s} | {m} | {bubble(s, m):.2f} | {schedule} | {cells} |")


def timed(function, clock):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            clock[0] += time.perf_counter() - start
    return run


def main():
    args = parse_args()
    init_distributed()
    if args.bubble:
        idle_fractions(args)
    else:
        compare(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
