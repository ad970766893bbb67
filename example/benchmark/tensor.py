"""tiny_zero's tensor parallelism against torch's own, on the example GPT.

    torchrun --nproc_per_node 2 example/benchmark/tensor.py --model small --steps 10 --repeat 3

Both split the same Linears over all ranks: in every block, attention's
c_attn and the MLP's c_fc by output features (torch: ColwiseParallel), the
c_proj after each by input features (RowwiseParallel); every other parameter
is whole on every rank. They start from the same weights (torch's c_attn
rows reordered so that its contiguous split gives each rank the q, k and v of
its own heads, as tiny_zero's ("column", 3) does), train on the same batch
(one replica: every rank takes it) with the same fp32 AdamW, and print the
same losses. The two alternate, --repeat times each; a step's time is the
median over the timed steps of the slowest rank's wall clock, and the ratio
compares each one's best repeat (other load on the machine only adds time).
The CPU time of the busiest rank's process stands beside it.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from example.data import ByteData, load_text
from example.model import CONFIGS, build_model
from example.tensor.train import PLAN
from tiny_zero.distributed import init_distributed, local_device
from tiny_zero.tensor import TensorParallel, TensorParallelAdamW

ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
TORCH_PLAN = {"blocks.*.attn.c_attn": ColwiseParallel(), "blocks.*.attn.c_proj": RowwiseParallel(),
              "blocks.*.mlp.c_fc": ColwiseParallel(), "blocks.*.mlp.c_proj": RowwiseParallel()}


def tiny_zero_run(args, device):
    model = TensorParallel(build_model(args.model, seed=args.seed), PLAN)
    return model, TensorParallelAdamW(model, **ADAMW), model.backward


def torch_run(args, device):
    module = build_model(args.model, seed=args.seed).to(device)
    world = dist.get_world_size()
    for block in module.blocks:  # [q; k; v] -> [q_0; k_0; v_0; q_1; k_1; v_1; ...]: rank r's rows together
        with torch.no_grad():
            for p in block.attn.c_attn.parameters():
                p.copy_(p.view(3, world, -1, *p.shape[1:]).transpose(0, 1).reshape(p.shape))
    parallelize_module(module, init_device_mesh(device.type, (world,)), TORCH_PLAN)
    opt = torch.optim.AdamW(module.parameters(), **ADAMW)
    return module, opt, lambda loss: loss.backward()


RUNS = {"tiny_zero": tiny_zero_run, "torch": torch_run}


def timed_steps(model, opt, backward, x, y, args, device):
    """(losses, median seconds per timed step: wall clock of the slowest rank,
    and CPU time of the busiest rank's process)."""
    losses, seconds = [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        loss = model(x, y)
        backward(loss)
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        losses.append(loss.item())
        if step >= args.warmup:
            seconds.append(elapsed.tolist())
    return losses, [statistics.median(s) for s in zip(*seconds)]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=list(CONFIGS), help="model size (default: small)")
    p.add_argument("--steps", type=int, default=10, help="timed steps, after the warm-up (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: 2)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the batch (default: 0)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each, in turn (default: 3)")
    args = p.parse_args()
    if min(args.steps, args.batch_size, args.seq_len, args.repeat) < 1 or args.warmup < 0:
        p.error("--steps, --batch-size, --seq-len and --repeat must be >= 1, --warmup >= 0")
    return args


def main():
    args = parse_args()
    rank, world = init_distributed()
    device = local_device()
    x, y = ByteData(load_text(), args.seq_len).get_batch("train", args.batch_size, 0, args.seed, 0, 1)
    x, y = x.to(device), y.to(device)
    times, cpu, losses = {name: [] for name in RUNS}, {name: [] for name in RUNS}, {}
    for repeat in range(args.repeat):
        for name, run in RUNS.items():
            losses[name], (seconds, cpu_seconds) = timed_steps(*run(args, device), x, y, args, device)
            times[name].append(seconds)
            cpu[name].append(cpu_seconds)
    if rank == 0:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"model {args.model}, {world} ranks ({where}, {dist.get_backend()}), batch {args.batch_size} x "
              f"{args.seq_len}, {args.warmup} warm-up + {args.steps} timed steps, {args.repeat} repeats each")
        print(f"losses, tiny_zero: {' '.join(f'{v:.5f}' for v in losses['tiny_zero'])}")
        print(f"losses, torch:     {' '.join(f'{v:.5f}' for v in losses['torch'])}")
        for name in RUNS:
            print(f"{name:<10} {min(times[name]) * 1e3:8.1f} ms/step (repeats: "
                  f"{', '.join(f'{t * 1e3:.1f}' for t in times[name])}), CPU {min(cpu[name]) * 1e3:.1f} ms/step")
        print(f"tiny_zero / torch: {min(times['tiny_zero']) / min(times['torch']):.3f} wall clock, "
              f"{min(cpu['tiny_zero']) / min(cpu['torch']):.3f} CPU time")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
