"""Large worlds by simulation: what one rank holds when gpt2-xl is wrapped
with zero3 and fsdp at 8, 64 and 512 ranks, measured in one process.

    python example/benchmark/scale.py                   # the tables in docs/scale.md (~10 min on 2 cores)
    python example/benchmark/scale.py --worlds 8 16 --model gpt2

torch's fake process group (backend "fake", store FakeStore) makes this
process rank r of a world of N whose collectives return at once and move
nothing. The wrapper therefore builds the partition it would build on N
ranks, and the rank holds exactly what it would hold there. The model is
built on the meta device; the wrapper materialises only this rank's part
(zero3: the tensors it owns; fsdp: its 1/N slice of every layer).

Printed, per world size:
  - the zero3 partition (tiny_zero.zero3.wrapper.owner_table; nothing
    materialised): elements on the most and least loaded rank, and max/mean
  - one training step on the rank (a batch of one token: forward, backward,
    grad clipping, AdamW step), counted by tiny_zero.measure.memory.TensorMemory from
    before the wrap: after the step, the bytes of parameters, gradients and
    optimizer state (fp32), next to ZeRO's 16Ψ/N; and the peak during the
    step, which adds the layers gathered for use and prefetch. The values
    computed are meaningless (the fake collectives deliver nothing), the bytes
    are exact. zero3 is measured on rank 0 and on its most and least loaded
    ranks, fsdp (whose ranks hold equal slices) on rank 0.
"""
import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch
import torch.distributed as dist

import tiny_zero
from example.model import CONFIGS, build_model
from tiny_zero.measure.memory import TensorMemory
from tiny_zero.zero3.wrapper import loads, owner_table

MiB = 2**20
STATE = ("parameters", "gradients", "optimizer_state")


def named_sizes(model_name):
    module = build_model(model_name, device="meta")
    return [(name, p.numel()) for name, p in module.named_parameters()]


def balance(model_name, world_size):
    """The zero3 partition of `model_name` over `world_size` ranks, from names and shapes alone."""
    sizes = named_sizes(model_name)
    owner = owner_table(sizes, world_size)
    load = loads(owner, sizes, world_size)
    total = sum(n for _, n in sizes)
    most, least = max(load), min(load)
    tensors_on = [0] * world_size
    for rank in owner.values():
        tensors_on[rank] += 1
    return {"numel": total, "tensors": len(sizes), "largest": max(n for _, n in sizes),
            "loads": load, "tensors_on": tensors_on,
            "most_loaded": load.index(most), "least_loaded": load.index(least),
            "max_over_mean": most * world_size / total, "min_over_mean": least * world_size / total}


def measure(strategy, model_name, world_size, rank, step=True):
    """Bytes rank `rank` of `world_size` holds for `model_name` under `strategy`:
    {"parameters", "gradients", "optimizer_state", "comm_buffers", "activations",
    "other"} after one training step (step=False: after the wrap, with the
    optimizer state created as the first step creates it, and no grads yet),
    and "peak": the most bytes alive during the step."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        module = build_model(model_name, device="meta")
        wrapper_cls, adamw_cls = tiny_zero.STRATEGIES[strategy]
        with TensorMemory() as memory:
            model = wrapper_cls(module)
            opt = adamw_cls(model, lr=1e-4)
            memory.attach(model, opt)  # the peak counts from here: the step, not the wrap
            if step:
                tokens = torch.zeros(1, 1, dtype=torch.long, device=model.device)
                loss = model(tokens, tokens)
                model.backward(loss)
                del loss
                model.clip_grad_norm_(1.0)
                opt.step()
            else:
                for shard in model.shards:
                    opt.adam_state(shard)
            held = memory.breakdown()
            held["peak"] = memory.peak
            del model, opt, module
            gc.collect()
        return held
    finally:
        dist.destroy_process_group()


def mib(n):
    return f"{n / MiB:,.1f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-xl", choices=list(CONFIGS), help="model config (default: gpt2-xl)")
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512], help="world sizes (default: 8 64 512)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    partitions = {n: balance(args.model, n) for n in args.worlds}
    first = partitions[args.worlds[0]]
    psi = first["numel"]
    print(f"{args.model}: Ψ = {psi:,} parameters in {first['tensors']} tensors, the largest "
          f"{first['largest']:,} ({first['largest'] / psi:.1%} of Ψ); fp32 AdamW: 16Ψ = {mib(16 * psi)} MiB\n")

    print("zero3 partition (whole tensors to ranks, largest first to the least loaded)\n")
    print("| N | mean elements per rank (Ψ/N) | most loaded rank | its elements | max/mean "
          "| least loaded rank | its elements | min/mean |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, b in partitions.items():
        print(f"| {n} | {psi / n:,.0f} | {b['most_loaded']} | {b['loads'][b['most_loaded']]:,} | "
              f"{b['max_over_mean']:.4f} | {b['least_loaded']} | {b['loads'][b['least_loaded']]:,} | "
              f"{b['min_over_mean']:.4f} |")

    print("\nmodel state on one rank after one step, MiB (fp32: 4 B params + 4 B grads + 8 B AdamW state)\n")
    print("| strategy | N | rank | parameters | gradients | optimizer state | model state | 16Ψ/N "
          "| model state / (16Ψ/N) | peak during the step | seconds |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, b in partitions.items():
        tags = {0: []}
        for tag, r in (("most loaded", b["most_loaded"]), ("least loaded", b["least_loaded"])):
            tags.setdefault(r, []).append(tag)
        zero3_ranks = {r: f"{r} ({', '.join(t)})" if t else str(r) for r, t in tags.items()}
        for strategy, ranks in (("zero3", zero3_ranks), ("fsdp", {0: "0"})):
            for r, label in ranks.items():
                start = time.perf_counter()
                held = measure(strategy, args.model, n, r)
                seconds = time.perf_counter() - start
                state = sum(held[k] for k in STATE)
                ideal = 16 * psi / n
                print(f"| {strategy} | {n} | {label} | {mib(held['parameters'])} | {mib(held['gradients'])} | "
                      f"{mib(held['optimizer_state'])} | {mib(state)} | {mib(ideal)} | {state / ideal:.3f} | "
                      f"{mib(held['peak'])} | {seconds:.0f} |", flush=True)
                left = {k: held[k] for k in ("comm_buffers", "activations") if held[k]}
                if left:
                    print(f"  (also alive after the step: {left})")


if __name__ == "__main__":
    main()
