"""torch.compile against eager, per strategy, next to torch DDP's.

    torchrun --nproc_per_node 2 example/benchmark/compile.py --model small

Each run (torch DDP, then each tiny_zero strategy named in --strategies) is
built from the same weights and trained on the same batch, eager and under
torch.compile (inductor), in rounds: a block of --steps steps of each run in
turn, --repeat times. Rank 0 prints each run's least block median (ms per
step, wall clock), the ratio compiled / eager, and the graphs dynamo made
for it. tiny_zero's layers run eagerly between the compiled graphs (their
forward is torch.compiler.disable'd): each is a graph break, so a model
compiles into the pieces between its layers.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch
import torch._dynamo

import tiny_zero
from example.benchmark.peers import torch_ddp
from example.model import CONFIGS, build_model
from tiny_zero.distributed import init_distributed


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=[n for n in CONFIGS if not n.startswith("llama")],
                   help="the example GPT's config (default: small)")
    p.add_argument("--strategies", default="ddp,zero3", help="tiny_zero strategies, comma-separated (default: ddp,zero3)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank (default: 4)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: 64)")
    p.add_argument("--steps", type=int, default=5, help="steps per block (default: 5)")
    p.add_argument("--repeat", type=int, default=5, help="rounds of blocks (default: 5)")
    return p.parse_args()


def build(name, model_name, compiled):
    """(step function, its model) for run `name`: torch DDP or a strategy."""
    module = build_model(model_name)
    if name == "torch_ddp":
        model = torch_ddp(module, torch.device("cpu"))
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    else:
        wrapper, adamw = tiny_zero.STRATEGIES[name]
        model = wrapper(module)
        opt = adamw(model, lr=1e-3)
    forward = torch.compile(model) if compiled else model

    def step(x, y):
        loss = forward(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def main():
    args = parse_args()
    rank, _ = init_distributed()
    torch.manual_seed(rank)
    vocab = CONFIGS[args.model].vocab_size
    x, y = (torch.randint(0, vocab, (args.batch_size, args.seq_len)) for _ in range(2))
    runs, graphs = {}, {}
    for name in ["torch_ddp", *args.strategies.split(",")]:
        for compiled in (False, True):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            step = build(name, args.model, compiled)
            step(x, y)  # compiles
            step(x, y)
            graphs[name, compiled] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            runs[name, compiled] = step
    blocks = {key: [] for key in runs}
    for _ in range(args.repeat):
        for key, step in runs.items():
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                step(x, y)
                times.append(time.perf_counter() - start)
            blocks[key].append(statistics.median(times))
    if rank == 0:
        print(f"{'run':<10} {'eager ms':>9} {'compiled ms':>12} {'ratio':>6} {'graphs':>7}")
        for name in dict.fromkeys(name for name, _ in runs):
            eager, compiled = (1000 * min(blocks[name, c]) for c in (False, True))
            print(f"{name:<10} {eager:9.1f} {compiled:12.1f} {compiled / eager:6.2f} {graphs[name, True]:7d}")


if __name__ == "__main__":
    main()
