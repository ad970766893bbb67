"""tiny_zero side by side with the implementations it should match.

    torchrun --nproc_per_node 2 example/benchmark/peers.py --model small --steps 12 --warmup 3 --plots docs

One process group, one run after another, each tiny_zero strategy beside
its matching peer: tiny_zero's ddp, zero1, zero2,
zero3 and fsdp; the torch peers (DistributedDataParallel, FSDP2's
fully_shard, ZeroRedundancyOptimizer); and DeepSpeed ZeRO stages 1, 2 and 3
twice each: with buckets the size of tiny_zero's (deepspeed_zero1, ...) and
with DeepSpeed's own defaults, which is what its users get
(deepspeed_zero1_defaults, ...). Every run builds the example GPT from the
same seed, trains on the same batches with the same fp32 AdamW
(torch.optim.AdamW inside DeepSpeed too), and records:

  memory  live tensor bytes per rank, counted (PeerMemory below, a
          tiny_zero.measure.memory.TensorMemory that also understands FSDP2's DTensors
          and resized storages) from before the model is built: everything a
          run allocates counts the same way. The peak is taken over the
          warm-up steps, from the first step on (so building the full model
          before sharding it is not the peak); from the second step on the
          peak repeats, so --warmup >= 2. The peak is split into what was
          alive at that moment: the parameters this rank keeps, gathered
          copies of parameters (ZeRO-3/FSDP), a separate fp32 master copy
          (DeepSpeed keeps one even in fp32), the optimizer state, other
          buffers that outlive the step (kept grads, buckets), and transient
          tensors (activations, grads freed by zero_grad, buckets in flight)
  time    the median wall-clock step over the timed steps (each step's time
          is its slowest rank's); no counting mode runs while timing. With
          --repeat R every run is repeated R times, in turn (each strategy
          next to its matching peer, the order reversed on every other
          repeat, so both sides of a pair see the same drift): the table gives
          the best repeat (other load only ever adds time) and the worst, and
          the ratios use the best. Also the CPU time per step (process time
          of the busiest rank), which other load disturbs less
  loss    every step's loss, averaged over ranks

Rank 0 prints two markdown tables: every run, and each tiny_zero strategy
against its matching peers (ddp: torch DDP; zero1: DeepSpeed 1 and
ZeroRedundancyOptimizer; zero2: DeepSpeed 2; zero3 and fsdp: DeepSpeed 3 and
FSDP2) with the targets: memory <= every peer's; wall-clock step time <=
1.05x the matching peer's (ddp: torch DDP; zero1, zero2, zero3: DeepSpeed's
stage with the same buckets; fsdp: FSDP2). With --plots DIR and matplotlib installed
(pip install -e ".[plot]") it writes DIR/memory_per_rank.png and
DIR/loss_curves.png.

DeepSpeed runs need `pip install deepspeed`; on a machine without CUDA they
run with DS_ACCELERATOR=cpu and gloo. Without deepspeed they are left out.
"""
import argparse
import gc
import importlib.util
import os
import platform
import statistics
import sys
import time
import weakref
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import tiny_zero
from example.data import ByteData, load_text
from example.model import CONFIGS, build_model, count_parameters
from tiny_zero.buckets import DEFAULT_BUCKET_BYTES
from tiny_zero.distributed import init_distributed, local_device
from tiny_zero.measure.memory import TensorMemory

ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)  # fp32, for every run

LOSS_REFERENCE = "torch_ddp"  # every run's losses are compared with this one's
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


# ---------------------------------------------------------------- builders
# A builder takes the freshly built GPT (on the CPU), the device, the AdamW
# hyperparameters and the per-rank batch size, and returns (model, optimizer,
# backward, close): one step is
#   loss = model(x, y); backward(loss); opt.step(); opt.zero_grad()
# and close() (or None) releases what the run leaves behind.

def tiny_zero_builder(name):
    def build(module, device, hyper, batch_size):
        wrapper_class, adamw_class = tiny_zero.STRATEGIES[name]
        model = wrapper_class(module, device=device)
        return model, adamw_class(model, **hyper), model.backward, None
    return build


def build_torch_ddp(module, device, hyper, batch_size):
    model = torch_ddp(module, device)
    return model, torch.optim.AdamW(model.parameters(), **hyper), torch.Tensor.backward, None


def build_torch_fsdp2(module, device, hyper, batch_size):
    module = torch_fsdp2(module, device)
    return module, torch.optim.AdamW(module.parameters(), **hyper), torch.Tensor.backward, None


def torch_fsdp2(module, device, **options):
    """The GPT sharded by FSDP2 (options: fully_shard's, as mp_policy)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    module.to(device)
    for block in module.blocks:  # one all-gather / reduce-scatter unit per transformer block
        fully_shard(block, mesh=mesh, **options)
    fully_shard(module, mesh=mesh, **options)  # the rest: embeddings (tied with the head), final LayerNorm
    return module


def build_torch_zero_redundancy(module, device, hyper, batch_size):
    model = torch_ddp(module, device)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **hyper)
    return model, opt, torch.Tensor.backward, None


def torch_ddp(module, device):
    module.to(device)
    return DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)


def deepspeed_builder(stage, defaults):
    def build(module, device, hyper, batch_size):
        deepspeed = import_deepspeed(device)
        config = deepspeed_config(stage, hyper, batch_size, defaults)
        module.to(device)
        engine, optimizer, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                                       config=config)
        return engine, EngineStep(engine), engine.backward, getattr(engine, "destroy", None)
    return build


def deepspeed_config(stage, hyper, batch_size, defaults):
    """fp32 ZeRO `stage` with torch.optim.AdamW inside, no clipping.
    defaults=False: every bucket of tiny_zero's size (DeepSpeed counts
    elements), and stage 3 shards every tensor and keeps nothing gathered
    after use, as tiny_zero does. defaults=True: zero_optimization is left
    at DeepSpeed's defaults (buckets of 5e8 elements, stage 3 keeping tensors
    under 1e5 elements whole)."""
    zero = {"stage": stage}
    if not defaults:
        elements = DEFAULT_BUCKET_BYTES // 4  # fp32
        zero.update(reduce_bucket_size=elements, allgather_bucket_size=elements)
        if stage == 3:
            zero.update(stage3_prefetch_bucket_size=elements, stage3_max_live_parameters=elements,
                        stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told otherwise; no other run clips
        "steps_per_print": 2**31,
        "optimizer": {"type": "AdamW", "params": {
            "lr": hyper["lr"], "betas": list(hyper["betas"]), "eps": hyper["eps"],
            "weight_decay": hyper["weight_decay"],
            "torch_adam": True,  # torch.optim.AdamW, not DeepSpeed's C++ Adam (a 50 s build on CPU)
        }},
        "zero_optimization": zero,
    }


def import_deepspeed(device):
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    import deepspeed
    import deepspeed.ops
    deepspeed.utils.logger.setLevel("WARNING")
    # Its process-group wrapper JIT-compiles a shared-memory all-reduce (~60 s
    # on 2 cores) that only inference and tensor parallelism use; training never does.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


class EngineStep:
    """DeepSpeed's engine.step() steps the optimizer and zeroes the grads."""

    def __init__(self, engine):
        self.engine = engine
        self.optimizer = engine.optimizer  # a ZeRO optimizer around torch.optim.AdamW

    def step(self):
        self.engine.step()

    def zero_grad(self):
        pass


PEERS = {
    "torch_ddp": build_torch_ddp,
    "torch_fsdp2": build_torch_fsdp2,
    "torch_zero_redundancy": build_torch_zero_redundancy,
    **{f"deepspeed_zero{stage}": deepspeed_builder(stage, defaults=False) for stage in (1, 2, 3)},
    **{f"deepspeed_zero{stage}_defaults": deepspeed_builder(stage, defaults=True) for stage in (1, 2, 3)},
}
RUNS = {**{name: tiny_zero_builder(name) for name in tiny_zero.STRATEGIES}, **PEERS}

# tiny_zero strategy -> its matching peers, each with the most its step time may be, as a multiple
# Each strategy's peers: {peer: its step-time target, × the peer's wall clock, or None}. The time
# target is against the matching peer only; memory is held to <= every peer's.
MATCHES = {
    "ddp": {"torch_ddp": 1.05},
    "zero1": {"deepspeed_zero1": 1.05, "deepspeed_zero1_defaults": None, "torch_zero_redundancy": None},
    "zero2": {"deepspeed_zero2": 1.05, "deepspeed_zero2_defaults": None},
    "zero3": {"deepspeed_zero3": 1.05, "deepspeed_zero3_defaults": None, "torch_fsdp2": None},
    "fsdp": {"torch_fsdp2": 1.05, "deepspeed_zero3": None, "deepspeed_zero3_defaults": None},
}


# ---------------------------------------------------------------- memory
PARTS = ["parameters", "gathered parameters", "fp32 master copy", "optimizer state", "other kept buffers",
         "activations", "transient"]


class PeerMemory(TensorMemory):
    """TensorMemory that also counts FSDP2 right, and splits the peak the
    same way for every run, whoever's its buffers are.

    FSDP2 holds its shards in DTensors, whose own storage reports the full
    (global) size, so a DTensor is counted by its local shard. And FSDP2
    frees a gathered parameter by resizing its storage to 0 bytes (and grows
    it again before the next all-gather), which no op reveals: so every
    storage's size is read again after each op. For storages that never
    change size (every other run's) the numbers are TensorMemory's.
    DeepSpeed allocates, views and frees with ordinary ops (its partitions,
    flat buffers and buckets are plain tensors), so nothing more is needed.

    TensorMemory's own breakdown (attach()) knows tiny_zero's wrappers; this
    one knows only what every run has: a model with parameters and a chain of
    optimizers ending in a torch.optim.Optimizer. After watch(model, opt),
    the storages alive at the peak are noted (as TensorMemory does: just
    before the next allocation or free), with which of them hold parameters,
    master copies, optimizer state and saved activations at that moment;
    breakdown() adds what outlives the step (see PARTS).
    """

    def __init__(self, device=None):
        super().__init__(device)
        self._alive = {}  # id(storage) -> weakref to it
        self._at_peak = {}  # id(storage) -> (bytes, weakref, part or None): alive at the peak
        self._peak_to_note = False
        self._watched = None  # (model, optimizer)

    def watch(self, model, opt):
        self._watched = (model, opt)
        self.reset_peak()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._resize_all()
        return out

    def reset_peak(self):
        super().reset_peak()
        self._peak_to_note = True
        self._settle()

    def _resize_all(self):
        for key, ref in self._alive.items():
            storage = ref()
            if storage is None:  # dying: its finalizer subtracts it
                continue
            size = storage.nbytes()
            if size != self._bytes[key]:
                self._settle()
                self.current += size - self._bytes[key]
                self._bytes[key] = size
                self._new_peak()

    def _add(self, storage):
        self._alive.setdefault(id(storage), weakref.ref(storage))
        super()._add(storage)
        self._new_peak()

    def _free(self, key):
        super()._free(key)  # which may first note the peak, with this storage in it
        del self._alive[key]

    def _new_peak(self):
        if self.current >= self.peak:
            self.peak = self.current
            self._peak_to_note = True

    def _settle(self):
        super()._settle()
        if self._peak_to_note:
            self._peak_to_note = False
            held = self._held() if self._watched else {}
            self._at_peak = {key: (size, self._alive[key], held.get(key, "activations" if self._saved[key] else None))
                             for key, size in self._bytes.items()}

    def _storages(self, obj):
        if isinstance(obj, DTensor):
            obj = obj._local_tensor
        yield from super()._storages(obj)

    def _held(self):
        """{id(storage): part} for what holds parameters, master copies and
        optimizer state now."""
        model, opt = self._watched
        optimizers = torch_optimizers(opt)
        # what the optimizer steps: its param_groups, and the keys of its state
        # (DeepSpeed stage 3 empties its param_groups between steps)
        stepped = [p for o in optimizers for g in o.param_groups for p in g["params"]] + \
                  [p for o in optimizers for p in o.state]
        held = {}
        for part, tensors in (("optimizer state", [o.state[p] for o in optimizers for p in o.state]),
                              ("fp32 master copy", stepped),
                              ("parameters", held_parameters(model))):  # last: a parameter is a parameter
            held.update(dict.fromkeys(self._keys(tensors), part))
        return held

    def _keys(self, tensors):
        return {id(s) for s in self._storages(list(tensors))}

    def breakdown(self):
        """{part: bytes} of the peak, once the step is over. A storage that
        held a parameter at the peak and is gone (or shrunk) now was a
        gathered copy; one that holds a parameter now, a parameter (FSDP2's
        shards are not module parameters while it computes); any other
        storage still alive is a kept buffer; what died since, transient
        (activations: what autograd had saved for backward)."""
        self._settle()
        at_rest = self._keys(held_parameters(self._watched[0]))
        parts = dict.fromkeys(PARTS, 0)
        for key, (size, ref, part) in self._at_peak.items():
            alive = ref() is not None and key in self._bytes
            kept = min(size, self._bytes[key]) if alive else 0
            if part == "parameters" or alive and key in at_rest:
                parts["parameters"] += kept
                parts["gathered parameters"] += size - kept
            elif part == "activations" and alive:  # saved for backward, and kept after it
                parts["other kept buffers"] += kept
            elif part is not None:
                parts[part] += size
            else:
                parts["other kept buffers"] += kept
        parts["transient"] = self.peak - sum(parts.values())
        return parts


def held_parameters(model):
    """The parameter tensors a rank holds: the module's (a DeepSpeed stage 3
    parameter keeps its shard in ds_tensor), and what a tiny_zero wrapper's
    optimizer steps (fsdp's slices are not module parameters)."""
    for p in model.parameters():
        yield p
        if getattr(p, "ds_tensor", None) is not None:
            yield p.ds_tensor
    yield from getattr(model, "shards", [])


def torch_optimizers(opt):
    """The torch.optim.Optimizers in a chain of wrappers (DeepSpeed's
    engine -> ZeRO optimizer -> AdamW; ZeroRedundancyOptimizer -> AdamW)."""
    found, seen = [], set()
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        if isinstance(opt, torch.optim.Optimizer):
            found.append(opt)
        opt = getattr(opt, "optimizer", None) or getattr(opt, "optim", None)
    return found


# ---------------------------------------------------------------- one run
def measure(name, args, data, device, count_memory=True):
    """Build and train one run. Returns its peak bytes (the most on any rank;
    on CUDA also torch.cuda.max_memory_allocated's) and their breakdown (of
    the rank with the most), the median step time in s (each step's slowest
    rank) and CPU time (the busiest rank's), and every step's loss (mean over
    ranks). count_memory=False: no counting mode at all (peaks are 0)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = [tuple(t.to(device) for t in data.get_batch("train", args.batch_size, step, args.seed, rank, world_size))
               for step in range(args.warmup + args.steps)]

    linear = F.linear  # DeepSpeed stage 3 replaces it for the whole process; put back below
    gc.collect()
    dist.barrier()
    losses, times, cpu_times = [], [], []
    memory = PeerMemory(device) if count_memory else None
    with memory if memory else nullcontext():
        model, opt, backward, close = RUNS[name](build_model(args.model, seed=args.seed), device, ADAMW,
                                                 args.batch_size)
        if memory:
            memory.watch(model, opt)  # and the peak starts again from here
        for x, y in batches[:args.warmup]:
            losses.append(train_step(model, opt, backward, x, y))
    parts = memory.breakdown() if memory else dict.fromkeys(PARTS, 0)
    peaks = [memory.peak if memory else 0, (memory.cuda_peak or 0) if memory and device.type == "cuda" else 0]
    for x, y in batches[args.warmup:]:
        sync(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(train_step(model, opt, backward, x, y))
        sync(device)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)

    peaks = torch.tensor(peaks, dtype=torch.float64, device=device)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (peaks[0].item(), parts))
    times = torch.tensor([times, cpu_times], dtype=torch.float64, device=device)
    losses = torch.stack(losses).double()
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(losses)
    result = dict(peak=peaks[0].item(), cuda_peak=peaks[1].item() if device.type == "cuda" else None,
                  parts=max(everyone, key=lambda e: e[0])[1],
                  step_s=statistics.median(times[0].tolist()), cpu_s=statistics.median(times[1].tolist()),
                  losses=(losses / world_size).tolist())
    if close is not None:
        close()
    F.linear = linear
    del model, opt, backward, close, memory
    gc.collect()
    return result


def train_step(model, opt, backward, x, y):
    loss = model(x, y)
    backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.detach()


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


def versions():
    found = [f"torch {torch.__version__}"]
    if HAS_DEEPSPEED:
        from importlib.metadata import version
        found.append(f"deepspeed {version('deepspeed')}")
    return ", ".join(found)


def mib(n):
    return f"{n / 2**20:.2f}"


def step_ms(r, key="step_s"):
    """The best repeat's median step, in ms, and (with repeats) the worst's."""
    times = [t * 1e3 for t in r[key]]
    return f"{min(times):.1f}" + (f" ({max(times):.1f})" if len(times) > 1 else "")


def runs_table(results):
    on_cuda = any(r["cuda_peak"] is not None for r in results.values())
    reference_losses = results.get(LOSS_REFERENCE, {}).get("losses")
    rows = [f"| run | peak MiB/rank | {' | '.join(PARTS)} |{' CUDA max allocated MiB |' if on_cuda else ''} "
            f"step ms (worst) | CPU ms per step (worst) | final loss | max abs loss diff vs {LOSS_REFERENCE} |",
            "|---|" + "---:|" * (len(PARTS) + 5 + on_cuda)]
    for name, r in results.items():
        cuda = f" {mib(r['cuda_peak'])} |" if on_cuda else ""
        diff = "–" if reference_losses is None else \
            f"{max(abs(a - b) for a, b in zip(r['losses'], reference_losses)):.2e}"
        rows.append(f"| {name} | {mib(r['peak'])} | {' | '.join(mib(r['parts'][p]) for p in PARTS)} |{cuda} "
                    f"{step_ms(r)} | {step_ms(r, 'cpu_s')} | {r['losses'][-1]:.6f} | {diff} |")
    return "\n".join(rows)


def targets_table(results):
    """Each tiny_zero strategy against its matching peers: the ratios, the
    targets, and whether they are met (time: the best repeat's wall clock)."""
    rows = ["| tiny_zero | peer | memory × peer | target | step time × peer | CPU time × peer | target | met |",
            "|---|---|---:|---:|---:|---:|---:|---|"]
    for ours, peers in MATCHES.items():
        for peer, time_limit in peers.items():
            if ours not in results or peer not in results:
                continue
            memory = results[ours]["peak"] / results[peer]["peak"]
            step, cpu = (min(results[ours][k]) / min(results[peer][k]) for k in ("step_s", "cpu_s"))
            timed = time_limit is not None
            missed = [what for what, ok in (("memory", memory <= 1.0), ("time", not timed or step <= time_limit))
                      if not ok]
            target = f"≤ {time_limit:.2f}" if timed else "–"
            rows.append(f"| {ours} | {peer} | {memory:.2f} | ≤ 1.00 | {step:.2f} | {cpu:.2f} | {target} "
                        f"| {'no: ' + ' and '.join(missed) if missed else 'yes'} |")
    return "\n".join(rows)


def write_plots(results, folder):
    """memory_per_rank.png (the peak, stacked by part) and loss_curves.png
    (every run's losses, and their difference from LOSS_REFERENCE's)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plots: matplotlib is not installed (pip install -e \".[plot]\"); no plots written")
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = list(results)[::-1]  # top to bottom in run order
    totals = [results[n]["peak"] / 2**20 for n in names]
    # A run far above the rest (DeepSpeed's default buckets) would flatten every
    # other bar: the axis stops short of it and the bar is labelled with its size.
    typical = statistics.median(totals)
    limit = 1.15 * max([t for t in totals if t <= 5 * typical] or totals)
    fig, ax = plt.subplots(figsize=(10, 0.38 * len(names) + 2))
    left = [0.0] * len(names)
    for part in PARTS:
        widths = [results[n]["parts"][part] / 2**20 for n in names]
        ax.barh(names, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    for i, total in enumerate(totals):
        if total > limit:  # the bar runs off the axis: its size is written on it
            ax.text(limit * 0.98, i, f"{total:,.0f} →", va="center", ha="right", fontsize=8, color="white")
        else:
            ax.text(total, i, f" {total:,.1f}", va="center", fontsize=8)
    ax.set_xlim(0, limit)
    ax.set_xlabel("peak live tensor MiB per rank (the rank with the most)")
    ax.set_title("Peak memory per rank, by what holds it", pad=34)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(folder / "memory_per_rank.png", dpi=120)
    plt.close(fig)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=[2, 1])
    reference = results.get(LOSS_REFERENCE, {}).get("losses")
    for i, n in enumerate(results):
        losses = results[n]["losses"]
        steps = range(1, len(losses) + 1)
        style = dict(linestyle="--" if n.startswith(("torch", "deepspeed")) else "-", linewidth=1,
                     color=plt.cm.tab20.colors[i % 20], label=n)
        top.plot(steps, losses, **style)
        if reference is not None:
            bottom.plot(steps, [a - b for a, b in zip(losses, reference)], **style)
    top.set_ylabel("loss (mean over ranks)")
    top.set_title("Loss curves of every run (they lie on top of each other)")
    top.legend(fontsize=7, ncol=3)
    bottom.set_ylabel(f"loss − {LOSS_REFERENCE}'s")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(folder / "loss_curves.png", dpi=120)
    plt.close(fig)
    print(f"plots: {folder / 'memory_per_rank.png'}, {folder / 'loss_curves.png'}")


def paired_order():
    """Every run, each tiny_zero strategy next to the peer its time is held
    to (ddp, torch_ddp, zero1, deepspeed_zero1, ...), then the rest."""
    order = []
    for ours, peers in MATCHES.items():
        timed = [peer for peer, limit in peers.items() if limit is not None]
        order += [name for name in [ours] + timed if name not in order]
    return order + [name for name in RUNS if name not in order]


def in_turn(names, repeat):
    """The runs of one repeat: in the given order, backwards on odd repeats
    (A B, B A, ...). The machine drifts over minutes and a run's place
    matters (the first in the process, the one after DeepSpeed's default
    buckets freed GBs): turning the order round gives each run both sides
    of its neighbour, and best-of-N then compares like with like."""
    return list(names) if repeat % 2 == 0 else list(reversed(names))


def parse_args():
    available = [name for name in paired_order() if HAS_DEEPSPEED or not name.startswith("deepspeed")]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=list(CONFIGS), help="model size (default: small)")
    p.add_argument("--steps", type=int, default=12, help="timed steps, after the warm-up (default: 12)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps, over which memory is counted (default: 3)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default: 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batches (default: 0)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run everything this many times, in turn; times are the best repeat's (default: 1)")
    p.add_argument("--plots", metavar="DIR", help="write memory_per_rank.png and loss_curves.png here (matplotlib)")
    p.add_argument("--only", default=",".join(available),
                   help=f"comma-separated runs, in this order, reversed on every other repeat "
                        f"(default: all of {','.join(available)})")
    args = p.parse_args()
    args.only = [name for name in args.only.split(",") if name]
    unknown = [name for name in args.only if name not in RUNS]
    if unknown or not args.only:
        p.error(f"--only: unknown run(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(RUNS)}")
    if not HAS_DEEPSPEED and any(name.startswith("deepspeed") for name in args.only):
        p.error("the deepspeed runs need deepspeed: pip install deepspeed")
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 1 or args.repeat < 1:
        p.error("--steps, --batch-size, --seq-len and --repeat must be >= 1")
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
        print(f"{machine(device)}; {versions()}; world size {world_size}; {dist.get_backend()}")
        print(f"model {args.model} ({n_params:,} parameters), fp32, batch {args.batch_size} x {args.seq_len} "
              f"tokens per rank, AdamW; {args.warmup} warm-up + {args.steps} timed steps, "
              f"{args.repeat} time(s) each\n", flush=True)
    results = {}
    for repeat in range(args.repeat):
        for name in in_turn(args.only, repeat):
            r = measure(name, args, data, device, count_memory=repeat == 0)
            if repeat == 0:
                results[name] = dict(r, step_s=[r["step_s"]], cpu_s=[r["cpu_s"]])
            else:
                results[name]["step_s"].append(r["step_s"])
                results[name]["cpu_s"].append(r["cpu_s"])
            if rank == 0:
                print(f"{name}: {r['step_s'] * 1e3:.1f} ms/step" + (f" (repeat {repeat + 1})" if repeat else ""),
                      flush=True)
    if rank == 0:
        print()
        print(runs_table(results))
        print()
        print(targets_table(results))
        print("\npeak: live tensor bytes from the first step to the end of the warm-up, on the rank with the most,")
        print("split by what holds each storage alive at the peak (transient: freed by the end of the warm-up).")
        print("step ms: median over the timed steps of the slowest rank's wall-clock step"
              + (f"; the best of {args.repeat} repeats (the worst in brackets)." if args.repeat > 1 else "."))
        print("CPU ms: the same for the CPU time of the busiest rank's process (all its threads): the work done,")
        print("which other load on a shared machine changes less than the wall clock.")
        if args.plots:
            write_plots(results, args.plots)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
