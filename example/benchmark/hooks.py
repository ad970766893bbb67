"""What module hooks cost next to tiny_zero's layers, per module, in host time.

    torchrun --nproc_per_node 2 example/benchmark/hooks.py --repeat 5

A stack of --depth small Linears trained by each strategy two ways: as
tiny_zero's Linear (the custom autograd layer), and as a Linear subclass
with a forward of its own, which tiny_zero reaches through module hooks
(tiny_zero/hooked.py, docs/module.md). The layers are small, so the step is
host time: the difference per module is what the hooks add to a forward and
a backward. Each run is the median step over --steps steps; the two ways run
in turn, --repeat times, and the table gives each one's best run.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tiny_zero  # noqa: E402


class OwnLinear(nn.Linear):
    """A Linear with a forward of its own: trained through module hooks."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def run(strategy, layer, args):
    """The median step time of one run, in seconds."""
    torch.manual_seed(0)
    wrapper, optimizer = tiny_zero.STRATEGIES[strategy]
    model = wrapper(nn.Sequential(*[layer(args.width, args.width) for _ in range(args.depth)]))
    opt = optimizer(model, lr=1e-3)
    x = torch.randn(4, args.width, device=model.device)
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[args.warmup:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", nargs="+", default=["ddp", "zero2", "zero3", "fsdp"])
    p.add_argument("--depth", type=int, default=32)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    best = {}
    for _ in range(args.repeat):
        for strategy in args.strategies:
            for name, layer in (("layer", nn.Linear), ("hooked", OwnLinear)):
                t = run(strategy, layer, args)
                best[strategy, name] = min(best.get((strategy, name), t), t)
    if dist.get_rank() == 0:
        print(f"{args.depth} Linear({args.width}, {args.width}), {dist.get_world_size()} rank(s); best median step:")
        print(f"{'strategy':<10}{'layers ms':>11}{'hooked ms':>11}{'per module us':>15}")
        for strategy in args.strategies:
            layers, hooked = best[strategy, "layer"], best[strategy, "hooked"]
            print(f"{strategy:<10}{layers * 1e3:>11.2f}{hooked * 1e3:>11.2f}{(hooked - layers) / args.depth * 1e6:>15.1f}")


if __name__ == "__main__":
    main()
