"""tiny_zero on one GPU: the AdamW kernel's bandwidth, and GPT-2 training steps.

    python example/benchmark/gpu.py                                  # everything: about 90 s on one H100
    python example/benchmark/gpu.py --models gpt2 --runs torch ddp   # some of it (torch is always the baseline)

Prints markdown tables:

(1) The fused AdamW update (tiny_zero.optim.adamw_update_, which runs the
    Triton kernel on CUDA) on flat tensors of 1M to 1B elements, in GB/s,
    next to a device-to-device copy of fp32 and torch.optim.AdamW(fused=True)
    stepping one parameter of the same size. Bytes are counted as moved:
    copy 4 B read + 4 B written per element; AdamW 28 B (param, grad,
    exp_avg, exp_avg_sq read, fp32; param, exp_avg, exp_avg_sq written); with
    a bf16 grad and a bf16 param_out also 28 B (2 B less read, 2 B more
    written). Each time is triton.testing.do_bench's median, which flushes
    the L2 cache before every call. A size that does not fit in free GPU
    memory is skipped, with a line saying so.

(2) GPT-2 124M (gpt2) and 350M (gpt2-medium) from example/model.py, bf16, one
    process (world 1, NCCL): plain torch, torch's DDP and FSDP2 (fully_shard
    per block), tiny_zero's layers on one device, and every strategy in
    tiny_zero.STRATEGIES. Every run starts from the same weights and trains
    on the same batch. ms/step is the median of the timed steps (CUDA
    events), after warm-up steps (the first compiles the Triton kernels);
    MFU and the formula it uses are printed with the table; memory is the
    peak of torch.cuda.max_memory_allocated over the run, less what was
    allocated before it. Each run's time and memory are also given as ratios
    to plain torch's. A row is printed as soon as it is measured.

On a machine without CUDA it runs too (tests/test_gpu_script.py calls main()
with tiny sizes there): the update then takes the torch path, times are
wall-clock, and memory is not measured.
"""
import argparse
import copy
import datetime
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

import tiny_zero
from example.benchmark.peers import torch_ddp, torch_fsdp2
from example.model import build_model, count_parameters
from tiny_zero.distributed import init_distributed
from tiny_zero.module import swap_layers
from tiny_zero.optim import AdamW, adamw_update_

SIZES = (10**6, 10**7, 10**8, 10**9)
MODELS = ("gpt2", "gpt2-medium")
BATCH, SEQ_LEN, WARMUP, STEPS = 8, 1024, 4, 12
HYPER = dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
PEAK_FLOPS = 989e12  # H100 SXM, bf16 dense (tensor cores), from NVIDIA's datasheet
# Tiny-DeepSpeed's published single-GPU peak memory (their README; their batch and sequence length)
TINY_DEEPSPEED_GB = {"gpt2": 4.65, "gpt2-medium": 10.12, "gpt2-large": 17.35}
RUNS = ("torch", "torch_ddp", "torch_fsdp2", "single_device") + tuple(tiny_zero.STRATEGIES)
BYTES_PER_ELEMENT = {"copy": 8, "adamw": 28}


def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def time_ms(fn):
    """Median milliseconds of one call of fn."""
    if torch.cuda.is_available():
        from triton.testing import do_bench  # CUDA events; L2 flushed before each call
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def gb_per_s(kind, n, ms):
    return BYTES_PER_ELEMENT[kind] * n / ms / 1e6


# ---------------------------------------------------------------- (1) AdamW kernel

def fits(n):
    """Room for the largest case: 4 fp32 tensors of n elements, plus slack."""
    return not torch.cuda.is_available() or 20 * n < torch.cuda.mem_get_info()[0]


def kernel_row(n):
    dev = device()
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    row = {"n": n, "copy": gb_per_s("copy", n, time_ms(lambda: dst.copy_(src)))}
    del src, dst

    p, g, m = (torch.randn(n, device=dev) for _ in range(3))
    v = torch.rand(n, device=dev)  # a second moment is never negative
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=10)
    row["tiny_zero"] = gb_per_s("adamw", n, time_ms(lambda: adamw_update_(p, g, m, v, **hyper)))
    g, out = g.bfloat16(), torch.empty(n, dtype=torch.bfloat16, device=dev)
    row["tiny_zero_bf16"] = gb_per_s("adamw", n, time_ms(
        lambda: adamw_update_(p, g, m, v, **hyper, param_out=out)))
    del p, g, m, v, out

    param = torch.nn.Parameter(torch.randn(n, device=dev))
    param.grad = torch.randn(n, device=dev)
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.1, fused=True)
    row["torch_fused"] = gb_per_s("adamw", n, time_ms(opt.step))
    return row


def kernel_table(sizes):
    rows = []
    for n in sizes:
        if fits(n):
            rows.append(kernel_row(n))
        else:
            print(f"skipped {n:,} elements: needs about {20 * n / 1e9:.0f} GB of GPU memory, "
                  f"{torch.cuda.mem_get_info()[0] / 1e9:.0f} GB free")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def figure(x):
    """Whole numbers, but two significant digits under 10 (tiny CPU runs)."""
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def print_kernel_table(rows):
    print("| elements | copy GB/s | tiny_zero GB/s | of copy | torch fused GB/s | tiny_zero / torch fused "
          "| tiny_zero bf16 grad + param_out GB/s | of copy |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['n']:,} | {figure(r['copy'])} | {figure(r['tiny_zero'])} | {r['tiny_zero'] / r['copy']:.1%} "
              f"| {figure(r['torch_fused'])} | {r['tiny_zero'] / r['torch_fused']:.2f}x "
              f"| {figure(r['tiny_zero_bf16'])} | {r['tiny_zero_bf16'] / r['copy']:.1%} |")


# ---------------------------------------------------------------- (2) GPT-2 steps

def torch_run(run, module):
    """torch's module for a torch run: itself, wrapped by DDP, or sharded by FSDP2 (world 1)."""
    if run == "torch":
        return module.to(device())
    init_distributed()
    if run == "torch_ddp":
        return torch_ddp(module, device())
    return torch_fsdp2(module, device(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))


def build_run(run, module):
    """(forward_backward(x, y) -> loss, optimizer) for one run over `module` (fp32, on the CPU)."""
    if run.startswith("torch"):  # fp32 weights, bf16 compute under autocast: how plain torch trains in bf16
        module = torch_run(run, module)
        opt = torch.optim.AdamW(module.parameters(), fused=True, **HYPER)

        def forward_backward(x, y):
            with torch.autocast(device().type, dtype=torch.bfloat16):
                loss = module(x, y)
            loss.backward()
            return loss
        return forward_backward, opt
    if run == "single_device":  # bf16 weights; tiny_zero's AdamW keeps fp32 masters
        swap_layers(module)
        module.to(device=device(), dtype=torch.bfloat16)
        opt = AdamW(module.parameters(), **HYPER)

        def forward_backward(x, y):
            loss = module(x, y)
            loss.backward()
            return loss
        return forward_backward, opt
    wrapper_class, adamw_class = tiny_zero.STRATEGIES[run]
    model = wrapper_class(module, mixed_precision="bf16")
    opt = adamw_class(model, **HYPER)

    def forward_backward(x, y):
        loss = model(x, y)
        model.backward(loss)
        return loss
    return forward_backward, opt


def step_times(step, warmup, steps):
    """Milliseconds of each timed step, after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    if not torch.cuda.is_available():
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def flops_per_step(module, batch, seq_len):
    """6·N per token for the matmuls of forward and backward, N the parameters
    less the position embedding (a lookup); plus 12·layers·width·seq_len per
    token for attention's two matmuls (scores and values), forward and backward."""
    cfg = module.config
    n = count_parameters(module) - module.wpe.weight.numel()
    tokens = batch * seq_len
    return 6 * n * tokens + 12 * cfg.n_layer * cfg.n_embd * seq_len * tokens


def run_model(run, base, x, y, warmup, steps):
    module = copy.deepcopy(base)
    flops = flops_per_step(module, *x.shape)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    forward_backward, opt = build_run(run, module)
    losses = []

    def step():
        losses.append(forward_backward(x, y).detach())
        opt.step()
        opt.zero_grad()
    ms = statistics.median(step_times(step, warmup, steps))
    row = {"run": run, "ms": ms, "tokens_per_s": x.numel() / ms * 1e3, "mfu": flops / (ms / 1e3) / PEAK_FLOPS,
           "loss": losses[-1].item(), "peak_gb": (torch.cuda.max_memory_allocated() - before) / 1e9 if cuda else None}
    del forward_backward, opt, module, losses, step
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def model_table(name, runs, batch, seq_len, warmup, steps):
    """Measure each run on `name` and print its row at once; torch's, the
    baseline of the ratios, first."""
    started = time.perf_counter()
    base = build_model(name)  # fp32 on the CPU; each run takes a copy
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, base.config.vocab_size, (batch, seq_len + 1), generator=gen).to(device())
    x, y = tokens[:, :-1], tokens[:, 1:]
    print(f"\n{name}: {count_parameters(base) / 1e6:.1f}M parameters")
    print("| run | ms/step | tokens/s | MFU | peak memory GB | vs torch (time) | vs torch (memory) "
          "| Tiny-DeepSpeed GB (theirs) | loss at last step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    torch_row = None
    for run in runs:
        row = run_model(run, base, x, y, warmup, steps)
        torch_row = torch_row or row
        print_row(name, row, torch_row)
    print(f"({name}: {time.perf_counter() - started:.0f} s in all)")


def print_row(name, r, torch_row):
    theirs = TINY_DEEPSPEED_GB.get(name)
    memory = f"{r['peak_gb']:.2f}" if r["peak_gb"] is not None else "n/a"
    memory_ratio = f"{r['peak_gb'] / torch_row['peak_gb']:.2f}" if r["peak_gb"] is not None else "n/a"
    print(f"| {r['run']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {memory} "
          f"| {r['ms'] / torch_row['ms']:.2f} | {memory_ratio} | {theirs if theirs else '-'} | {r['loss']:.4f} |",
          flush=True)


# ---------------------------------------------------------------- main

def print_header():
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (CPU)"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    print(f"{gpu}; torch {torch.__version__}; triton {triton_version}; {datetime.date.today()}")


def main(sizes=SIZES, models=MODELS, runs=RUNS, batch=BATCH, seq_len=SEQ_LEN, warmup=WARMUP, steps=STEPS):
    runs = ["torch"] + [run for run in runs if run != "torch"]  # the baseline of every ratio
    print_header()
    print("\n(1) AdamW update, GB/s (bytes read + written per second; do_bench median, L2 flushed per call)")
    print_kernel_table(kernel_table(sizes))
    print("A call on fewer than ~100M elements lasts microseconds, and fixed costs (launch, ramp-up, tail) weigh "
          "more on the copy's 8 B/element than on AdamW's 28: 'of copy' compares bandwidths from 100M elements up.")
    print(f"\n(2) GPT-2, bf16, world 1, batch {batch} x {seq_len} tokens; median of {steps} steps after "
          f"{warmup} warm-up steps")
    print("torch: torch.nn layers, fp32 parameters, torch.autocast(bfloat16), torch.optim.AdamW(fused=True).")
    print("torch_ddp: the same in torch's DistributedDataParallel. torch_fsdp2: the same sharded by fully_shard "
          "per block with MixedPrecisionPolicy(param_dtype=bfloat16), under the same autocast.")
    print("single_device: tiny_zero layers (tiny_zero.module.swap_layers), bf16 parameters, tiny_zero.optim.AdamW "
          "(fp32 masters).")
    print("ddp ... fsdp: tiny_zero.STRATEGIES[name], mixed_precision='bf16'.")
    print(f"MFU = (6·N·tokens + 12·layers·width·seq_len·tokens) / step time / {PEAK_FLOPS / 1e12:.0f} TFLOP/s "
          "(H100 SXM bf16 dense peak); N = parameters less the position embedding.")
    print("peak memory: torch.cuda.max_memory_allocated during the run, in GB (1e9 bytes), less what was "
          "allocated before it. Tiny-DeepSpeed GB: their published single-GPU figure, their own batch and "
          f"setup (gpt2-large: {TINY_DEEPSPEED_GB['gpt2-large']} GB), for reference only.")
    for name in models:
        model_table(name, runs, batch, seq_len, warmup, steps)
    if dist.is_initialized():  # the strategies' world-1 process group
        dist.destroy_process_group()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS, metavar="MODEL", help=f"default: {' '.join(MODELS)}")
    parser.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS, metavar="RUN",
                        help=f"of {' '.join(RUNS)} (default: all; torch always runs, as the baseline)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps per run (default %(default)s)")
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per run (default %(default)s)")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    main(models=args.models, runs=args.runs, warmup=args.warmup, steps=args.steps)
