"""Host time per step: what runs around the math, next to torch's.

    python example/benchmark/host.py --model gpt2

One process, one thread, a world of one (gloo), on the CPU (a GPU is hidden). The model has the blocks of
--model (gpt2: 12) at width 16, with a 64-token vocabulary, on a batch of
1 x 8 tokens: its math takes microseconds a layer, so a step's time is
nearly all Python, autograd and the calls into torch and torch.distributed.
On a GPU that host time is what a step costs whenever it exceeds the
kernels' time (docs/benchmarks.md, GPU). Each run is built once, from the
same weights, and trained on the same batch in rounds: a block of --steps
steps of each run in turn, --repeat times:

  torch          torch.nn layers, torch.optim.AdamW(fused=True): torch's fastest loop
  torch_ddp      the same, wrapped in torch's DistributedDataParallel
  torch_fsdp2    the same, sharded by FSDP2's fully_shard, a unit per block
  single_device  tiny_zero.module.swap_layers and tiny_zero.optim.AdamW
  ddp ... fsdp   each of tiny_zero.STRATEGIES, wrapped at world size 1

torch_ddp's and torch_fsdp2's ratios are what torch's own wrappers add to a
step's host time. tiny_zero's single_device, ddp, zero1, zero2 and offload
aim at 1.30x torch at most, its zero3 and fsdp at 1.60x, below half of FSDP2's.

The table gives each run's least block median (other load only ever adds
time; rounds give every run the machine's quiet moments alike), its ratio
to torch's, and the loss of its last step (the same computation throughout,
so they agree to float rounding).
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled
# the host's time, measured on its CPU: a GPU in sight would take the
# parameters (and NCCL the process group) while the batch stayed here
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch

import tiny_zero
from example.benchmark.peers import torch_ddp, torch_fsdp2
from example.model import CONFIGS, build_model
from tiny_zero.distributed import init_distributed
from tiny_zero.module.swap import swap_layers
from tiny_zero.optim import AdamW

HYPER = dict(lr=1e-3, weight_decay=0.1)
TORCH_RUNS = {"torch": lambda model: model,
              "torch_ddp": lambda model: torch_ddp(model, torch.device("cpu")),
              "torch_fsdp2": lambda model: torch_fsdp2(model, torch.device("cpu"))}
NARROW = dict(n_embd=16, n_head=2, vocab_size=64, block_size=16)  # the layers of --model, next to no math


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpts = [name for name in CONFIGS if not name.startswith("llama")]
    p.add_argument("--model", default="gpt2", choices=gpts, help="whose blocks (default: gpt2, 12)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per block (default: 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each run first (default: 3)")
    p.add_argument("--repeat", type=int, default=30, help="rounds: a block of each run, in turn (default: 30)")
    return p.parse_args()


def build(name, model_name):
    """(model, optimizer, backward) of one run, from the same seed."""
    model = build_model(model_name, seed=0, **NARROW)
    if name in TORCH_RUNS:
        model = TORCH_RUNS[name](model)
        return model, torch.optim.AdamW(model.parameters(), fused=True, **HYPER), torch.Tensor.backward
    if name == "single_device":
        swap_layers(model)
        return model, AdamW(model.parameters(), **HYPER), torch.Tensor.backward
    wrapper_class, adamw_class = tiny_zero.STRATEGIES[name]
    model = wrapper_class(model)
    return model, adamw_class(model, **HYPER), model.backward


class Run:
    """One run's model, optimizer and backward, built once and stepped in blocks."""

    def __init__(self, name, args):
        self.model, self.opt, self.backward = build(name, args.model)
        self.medians, self.loss = [], None

    def steps(self, x, y, n, timed=True):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            loss = self.model(x, y)
            self.backward(loss)
            self.opt.step()
            self.opt.zero_grad()
            times.append((time.perf_counter() - start) * 1e3)
        self.loss = loss.item()
        if timed:
            self.medians.append(statistics.median(times))


def main():
    args = parse_args()
    torch.set_num_threads(1)
    init_distributed()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, NARROW["vocab_size"], (1, 9), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    runs = {name: Run(name, args) for name in [*TORCH_RUNS, "single_device", *tiny_zero.STRATEGIES]}
    for run in runs.values():
        run.steps(x, y, args.warmup, timed=False)
    # rounds of a short block each, in turn: every run meets the machine's
    # quiet moments and its busy ones alike, and the least of its block
    # medians is its time (other load only ever adds time)
    for _ in range(args.repeat):
        for run in runs.values():
            run.steps(x, y, args.steps)
    best = {name: (min(run.medians), run.loss) for name, run in runs.items()}
    blocks = CONFIGS[args.model].n_layer
    print(f"--model {args.model}: {blocks} blocks at width 16, 1 x 8 tokens, fp32, 1 thread, world 1; "
          f"least of {args.repeat} rounds' block medians ({args.steps} steps a block)")
    print("| run | host ms/step | × torch | loss, last step |")
    print("|---|---:|---:|---:|")
    for name, (ms, loss) in best.items():
        print(f"| {name} | {ms:.2f} | {ms / best['torch'][0]:.2f} | {loss:.6f} |")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
