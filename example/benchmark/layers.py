"""tiny_zero's layers and AdamW on one device, next to torch.nn and torch.optim.

    python example/benchmark/layers.py --model small --repeat 15

One process, fp32, the example GPT: the same weights and the same batch
every step, trained by

  torch      the model as built (torch.nn layers) with torch.optim.AdamW
  tiny_zero  the same model after tiny_zero.module.swap_layers (tiny_zero's
             layers, hand-written backward, the fused norm path where it
             applies) with tiny_zero.optim.AdamW

a step being forward, backward, AdamW and zero_grad. The two run in turn,
--repeat times; each run's time is the median wall-clock step over --steps
steps after --warmup untimed ones, and the table gives each side's best run
(other load only ever adds time), the wall-clock ratio, the ratio of the
two sides' median runs (how far luck in the best run goes), the CPU-time
ratio beside them (process time, all threads), and the losses of the last step
(the two compute the same thing, so they agree to float rounding).
"""
import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch

from example.model import CONFIGS, build_model
from tiny_zero.module.swap import swap_layers
from tiny_zero.optim import AdamW

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=list(CONFIGS), help="model size (default: small)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default: 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    p.add_argument("--repeat", type=int, default=15, help="runs of each side, in turn (default: 15)")
    return p.parse_args()


def build(side, base):
    """(model, optimizer) of one side, from a copy of the same weights."""
    model = copy.deepcopy(base)
    if side == "torch":
        return model, torch.optim.AdamW(model.parameters(), **HYPER)
    swap_layers(model)
    return model, AdamW(model.parameters(), **HYPER)


def timed_run(side, base, x, y, args):
    """(median wall ms, median CPU ms, last loss) of one run."""
    model, opt = build(side, base)
    walls, cpus = [], []
    for step in range(args.warmup + args.steps):
        wall, cpu = time.perf_counter(), time.process_time()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= args.warmup:
            walls.append((time.perf_counter() - wall) * 1e3)
            cpus.append((time.process_time() - cpu) * 1e3)
    return statistics.median(walls), statistics.median(cpus), loss.item()


def main():
    args = parse_args()
    base = build_model(args.model, seed=0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, base.config.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    runs = {"torch": [], "tiny_zero": []}
    for _ in range(args.repeat):
        for side in runs:
            runs[side].append(timed_run(side, base, x, y, args))
    best = {side: min(found) for side, found in runs.items()}
    middle = {side: statistics.median(w for w, _, _ in found) for side, found in runs.items()}
    cpu = {side: min(c for _, c, _ in found) for side, found in runs.items()}
    print(f"--model {args.model}, {args.batch_size} x {args.seq_len} tokens, fp32, {torch.get_num_threads()} "
          f"thread(s); best of {args.repeat} runs of {args.steps} steps each (median step)")
    print("| side | wall ms/step (worst run) | × torch | median runs × torch | CPU ms/step | × torch | loss, last step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for side, found in runs.items():
        wall, _, loss = best[side]
        worst = max(w for w, _, _ in found)
        print(f"| {side} | {wall:.1f} ({worst:.1f}) | {wall / best['torch'][0]:.3f} | "
              f"{middle[side] / middle['torch']:.3f} | {cpu[side]:.1f} "
              f"| {cpu[side] / cpu['torch']:.3f} | {loss:.6f} |")


if __name__ == "__main__":
    main()
