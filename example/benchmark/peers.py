"""tiny_zero side by side with the implementations it should match.

    torchrun --nproc_per_node 2 example/benchmark/peers.py --model small --steps 12 --warmup 3

One process group, one run after another: tiny_zero's ddp, zero1, zero2,
zero3 and fsdp, and the torch peers (DistributedDataParallel, FSDP2's
fully_shard, ZeroRedundancyOptimizer). Every run builds the example GPT from
the same seed, trains on the same batches with the same fp32 AdamW, and
records:

  memory  live tensor bytes per rank, counted (PeerMemory below, a
          tiny_zero.memory.TensorMemory that also understands FSDP2) from
          before the model is built: everything a run allocates counts the
          same way. The peak is taken over the warm-up steps, from the first
          step on (so building the full model before sharding it is not the
          peak). From the second step on the peak repeats, so --warmup >= 2
  time    the median wall-clock step over the timed steps (each step's time
          is its slowest rank's); no counting mode runs while timing
  loss    every step's loss, averaged over ranks

Rank 0 prints a markdown table with each run's ratios to its reference:
torch DDP for ddp, zero1 and zero2; FSDP2 for zero3 and fsdp; tiny_zero's
zero1 for ZeroRedundancyOptimizer. To add a peer (DeepSpeed, say), write a
builder, add it to PEERS and name its reference in REFERENCE.
"""
import argparse
import gc
import platform
import statistics
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import tiny_zero
from example.data import ByteData, load_text
from example.model import CONFIGS, build_model, count_parameters
from tiny_zero.distributed import init_distributed, local_device
from tiny_zero.memory import TensorMemory

ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)  # fp32, for every run
LOSS_REFERENCE = "torch_ddp"  # every run's losses are compared with this one's


# ---------------------------------------------------------------- builders
# A builder takes the freshly built GPT (on the CPU), the device and the AdamW
# hyperparameters, and returns (model, optimizer, backward): one step is
#   loss = model(x, y); backward(loss); opt.step(); opt.zero_grad()

def tiny_zero_builder(name):
    def build(module, device, hyper):
        wrapper_class, adamw_class = tiny_zero.STRATEGIES[name]
        model = wrapper_class(module, device=device)
        return model, adamw_class(model, **hyper), model.backward
    return build


def build_torch_ddp(module, device, hyper):
    model = torch_ddp(module, device)
    return model, torch.optim.AdamW(model.parameters(), **hyper), torch.Tensor.backward


def build_torch_fsdp2(module, device, hyper):
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    module.to(device)
    for block in module.blocks:  # one all-gather / reduce-scatter unit per transformer block
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)  # the rest: embeddings (tied with the head), final LayerNorm
    return module, torch.optim.AdamW(module.parameters(), **hyper), torch.Tensor.backward


def build_torch_zero_redundancy(module, device, hyper):
    model = torch_ddp(module, device)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **hyper)
    return model, opt, torch.Tensor.backward


def torch_ddp(module, device):
    module.to(device)
    return DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)


PEERS = {
    "torch_ddp": build_torch_ddp,
    "torch_fsdp2": build_torch_fsdp2,
    "torch_zero_redundancy": build_torch_zero_redundancy,
    # "deepspeed_zero1": ..., "deepspeed_zero2": ..., "deepspeed_zero3": ...
}
RUNS = {**{name: tiny_zero_builder(name) for name in tiny_zero.STRATEGIES}, **PEERS}

# run -> the run its memory and time are divided by
REFERENCE = {
    "ddp": "torch_ddp",
    "zero1": "torch_ddp",
    "zero2": "torch_ddp",
    "zero3": "torch_fsdp2",
    "fsdp": "torch_fsdp2",
    "torch_zero_redundancy": "zero1",
}


# ---------------------------------------------------------------- memory
class PeerMemory(TensorMemory):
    """TensorMemory that also counts FSDP2 right.

    FSDP2 holds its shards in DTensors, whose own storage reports the full
    (global) size, so a DTensor is counted by its local shard. And FSDP2
    frees a gathered parameter by resizing its storage to 0 bytes (and grows
    it again before the next all-gather), which no op reveals: so every
    storage's size is read again after each op. For storages that never
    change size (every other run's) the numbers are TensorMemory's.
    """

    def __init__(self, device=None):
        super().__init__(device)
        self._alive = {}  # id(storage) -> weakref to it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._resize_all()
        return out

    def _resize_all(self):
        for key, ref in self._alive.items():
            storage = ref()
            if storage is None:  # dying: its finalizer subtracts it
                continue
            size = storage.nbytes()
            if size != self._bytes[key]:
                self.current += size - self._bytes[key]
                self._bytes[key] = size
        self.peak = max(self.peak, self.current)

    def _add(self, storage):
        self._alive.setdefault(id(storage), weakref.ref(storage))
        super()._add(storage)

    def _free(self, key):
        del self._alive[key]
        super()._free(key)

    def _storages(self, obj):
        if isinstance(obj, DTensor):
            obj = obj._local_tensor
        yield from super()._storages(obj)


# ---------------------------------------------------------------- one run
def measure(name, args, data, device):
    """Build and train one run. Returns its peak bytes (the most on any rank;
    on CUDA also torch.cuda.max_memory_allocated's), the median step time in s
    (each step's slowest rank), and every step's loss (mean over ranks)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = [tuple(t.to(device) for t in data.get_batch("train", args.batch_size, step, args.seed, rank, world_size))
               for step in range(args.warmup + args.steps)]

    def train_step(x, y):
        loss = model(x, y)
        backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    gc.collect()
    dist.barrier()
    losses, times = [], []
    with PeerMemory(device) as memory:
        model, opt, backward = RUNS[name](build_model(args.model, seed=args.seed), device, ADAMW)
        memory.reset_peak()
        for x, y in batches[:args.warmup]:
            losses.append(train_step(x, y))
    peaks = [memory.peak] + ([memory.cuda_peak] if device.type == "cuda" else [])
    for x, y in batches[args.warmup:]:
        sync(device)
        start = time.perf_counter()
        losses.append(train_step(x, y))
        sync(device)
        times.append(time.perf_counter() - start)

    peaks = torch.tensor(peaks, dtype=torch.float64, device=device)
    times = torch.tensor(times, dtype=torch.float64, device=device)
    losses = torch.stack(losses).double()
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(losses)
    result = dict(peak=peaks[0].item(), cuda_peak=peaks[1].item() if len(peaks) > 1 else None,
                  step_s=statistics.median(times.tolist()), losses=(losses / world_size).tolist())
    del model, opt, backward, memory
    gc.collect()
    return result


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- report
def machine(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"CPU: {names[0]} ({len(names)} logical cores)"
    except (OSError, IndexError):
        return f"CPU: {platform.processor() or platform.machine()}"


def ratio(results, name, key):
    ref = REFERENCE.get(name)
    if ref not in results:
        return "", "–"
    return ref, f"{results[name][key] / results[ref][key]:.2f}"


def table(results):
    on_cuda = any(r["cuda_peak"] is not None for r in results.values())
    cuda_header = " CUDA max allocated MiB | × ref |" if on_cuda else ""
    rows = [f"| run | reference | peak MiB/rank | × ref |{cuda_header} step ms (median) | × ref | final loss "
            f"| max abs loss diff vs {LOSS_REFERENCE} |",
            "|---|---|" + "---:|" * (8 if on_cuda else 6)]
    reference_losses = results.get(LOSS_REFERENCE, {}).get("losses")
    for name, r in results.items():
        ref, memory_ratio = ratio(results, name, "peak")
        _, time_ratio = ratio(results, name, "step_s")
        cuda = f" {r['cuda_peak'] / 2**20:.2f} | {ratio(results, name, 'cuda_peak')[1]} |" if on_cuda else ""
        diff = "–" if reference_losses is None else \
            f"{max(abs(a - b) for a, b in zip(r['losses'], reference_losses)):.2e}"
        rows.append(f"| {name} | {ref or '–'} | {r['peak'] / 2**20:.2f} | {memory_ratio} |{cuda} "
                    f"{r['step_s'] * 1e3:.1f} | {time_ratio} | {r['losses'][-1]:.6f} | {diff} |")
    return "\n".join(rows)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=list(CONFIGS), help="model size (default: small)")
    p.add_argument("--steps", type=int, default=12, help="timed steps, after the warm-up (default: 12)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps, over which memory is counted (default: 3)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default: 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batches (default: 0)")
    p.add_argument("--only", default=",".join(RUNS),
                   help=f"comma-separated runs, in this order (default: all of {','.join(RUNS)})")
    args = p.parse_args()
    args.only = [name for name in args.only.split(",") if name]
    unknown = [name for name in args.only if name not in RUNS]
    if unknown or not args.only:
        p.error(f"--only: unknown run(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(RUNS)}")
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 1:
        p.error("--steps, --batch-size and --seq-len must be >= 1")
    if args.warmup < 2:
        p.error("--warmup must be >= 2: memory is counted over the warm-up steps, and the optimizer "
                "state exists from the end of the first one")
    if args.seq_len > CONFIGS[args.model].block_size:
        p.error(f"--seq-len {args.seq_len} is longer than model {args.model}'s block_size "
                f"{CONFIGS[args.model].block_size}")
    return args


def main():
    args = parse_args()
    data = ByteData(load_text(), args.seq_len)
    rank, world_size = init_distributed()
    device = local_device()
    if rank == 0:
        n_params = count_parameters(build_model(args.model, seed=args.seed, device="meta"))
        print(f"{machine(device)}; torch {torch.__version__}; world size {world_size}; {dist.get_backend()}")
        print(f"model {args.model} ({n_params:,} parameters), fp32, batch {args.batch_size} x {args.seq_len} "
              f"tokens per rank, AdamW; {args.warmup} warm-up + {args.steps} timed steps\n", flush=True)
    results = {}
    for name in args.only:
        results[name] = measure(name, args, data, device)
        if rank == 0:
            print(f"{name}: done", flush=True)
    if rank == 0:
        print()
        print(table(results))
        print("\npeak: live tensor bytes from the first step to the end of the warm-up, the most on any rank.")
        print("step ms: median over the timed steps of the slowest rank's wall-clock step.")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
