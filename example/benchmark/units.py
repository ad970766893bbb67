"""What the size of a unit trades in zero3 and fsdp: collectives against memory.

    torchrun --nproc_per_node 2 example/benchmark/units.py --model small --repeat 3

zero3 and fsdp gather and free their parameters a unit at a time. By default
a unit is one of the model's repeated blocks (as FSDP2 cuts a model);
`units=[]` makes each layer a unit of its own. Bigger units mean fewer,
larger collectives, and more parameters gathered at once. For each strategy
and unit size, from the same weights on the same batches:

  collectives   calls per training step, by kind (tiny_zero.comm.stats)
  peak          live tensor bytes per rank over two steps, counted from
                before the model is built (TensorMemory), on the rank with
                the most, and its comm_buffers part: what is gathered or in
                flight
  step          the median wall-clock step (each step's slowest rank), best
                of --repeat runs, the runs of one strategy in turn
  loss          the last step's, averaged over ranks: the unit size changes
                when parameters are gathered, never what is computed
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch
import torch.distributed as dist

import tiny_zero
from example.data import ByteData, load_text
from example.model import CONFIGS, build_model
from tiny_zero import comm
from tiny_zero.distributed import init_distributed, local_device
from tiny_zero.measure.memory import TensorMemory

UNITS = {"block": None, "layer": []}  # None: the model's repeated blocks; []: each layer on its own
HYPER = dict(lr=1e-3, weight_decay=0.1)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=list(CONFIGS), help="model size (default: small)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank (default: 8)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default: 10)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each, in turn (default: 3)")
    return p.parse_args()


def build(strategy, units, args, device):
    wrapper_class, adamw_class = tiny_zero.STRATEGIES[strategy]
    model = wrapper_class(build_model(args.model, seed=0), units=UNITS[units], device=device)
    return model, adamw_class(model, **HYPER)


def train_step(model, opt, x, y):
    loss = model(x, y)
    model.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def counted(strategy, units, batches, args, device):
    """(peak bytes, comm_buffers bytes at the peak, collectives per step) of two steps."""
    with TensorMemory() as memory:
        model, opt = build(strategy, units, args, device)
        memory.attach(model, opt)
        train_step(model, opt, *batches[0])
        comm.stats.reset()
        train_step(model, opt, *batches[1])
        memory.settle()
        calls = dict(comm.stats.calls)
        mine = torch.tensor([memory.peak, memory.peak_breakdown.get("comm_buffers", 0)], dtype=torch.float64,
                            device=device)  # NCCL sends only device tensors
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    peak, buffers = max(everyone, key=lambda t: t[0]).tolist()
    return peak, buffers, calls


def timed(strategy, units, batches, args, device):
    """(median step in s, last loss averaged over ranks) of one run."""
    model, opt = build(strategy, units, args, device)
    times = []
    for x, y in batches:
        dist.barrier()
        start = time.perf_counter()
        loss = train_step(model, opt, x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(loss)
    return statistics.median(slowest[1:].tolist()), loss.item() / dist.get_world_size()


def main():
    args = parse_args()
    rank, world_size = init_distributed()
    device = local_device()
    seq_len = CONFIGS[args.model].block_size
    data = ByteData(load_text(), seq_len)
    batches = [tuple(t.to(device) for t in data.get_batch("train", args.batch_size, step, 0, rank, world_size))
               for step in range(args.steps + 1)]  # the first step untimed
    runs = [(strategy, units) for strategy in ("zero3", "fsdp") for units in UNITS]
    counts = {run: counted(*run, batches, args, device) for run in runs}
    times = {run: [] for run in runs}
    for _ in range(args.repeat):
        for run in runs:
            times[run].append(timed(*run, batches, args, device))
    if rank == 0:
        print(f"--model {args.model}, {args.batch_size} x {seq_len} tokens per rank, world {world_size}, "
              f"fp32; best of {args.repeat} runs of {args.steps} timed steps (median step)")
        print("| strategy | units | collectives per step | peak MiB/rank | gathered or in flight MiB | step ms | loss |")
        print("|---|---|---|---:|---:|---:|---:|")
        for run in runs:
            peak, buffers, calls = counts[run]
            step, loss = min(times[run])
            kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(calls.items()))
            print(f"| {run[0]} | {run[1]} | {kinds} | {peak / 2**20:.2f} | {buffers / 2**20:.2f} | "
                  f"{step * 1e3:.1f} | {loss:.6f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
