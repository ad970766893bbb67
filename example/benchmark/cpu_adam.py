"""The CPU AdamW step of ZeRO-Offload against the other CPU AdamWs, per million parameters.

    python example/benchmark/cpu_adam.py --numel 8000000 --repeat 7

One flat fp32 tensor of --numel parameters, its grad and its moments, as a
rank of ZeRO-Offload steps them on the host. Each AdamW steps its own copy;
the runs take turns (interleaved), --repeat times, and each one's best time
counts (other load on the machine only ever adds time). Printed: the step
time per million parameters, the ratio to torch.optim.AdamW(foreach=False),
and how far each AdamW's parameters end from that one's after all the steps
(the share of elements that differ, and the largest difference; not for
bf16, whose grads differ).

    offload fp32        tiny_zero.optim.adamw_update_(kernel="fused"): what
                        ZeroOffloadAdamW runs, torch's fused kernel
    offload bf16        the same under bf16: a bf16 grad, and the bf16 copy of
                        the parameter written for the copy back to the device
    tiny_zero torch     adamw_update_(kernel="torch"): the other strategies' CPU path
    torch single-tensor torch.optim.AdamW(foreach=False)
    torch foreach       torch.optim.AdamW(foreach=True)
    torch fused         torch.optim.AdamW(fused=True)
    DeepSpeedCPUAdam    deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True), when
                        deepspeed is installed and its C++ op builds (the first
                        build takes minutes; DS_ACCELERATOR=cpu without a GPU)

All run on --threads threads (default: torch's, all cores unless set).
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch

from tiny_zero.optim import adamw_update_

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.1


def flat_tensors(numel, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g), torch.randn(numel, generator=g) * 1e-3


def tiny_zero_step(numel, kernel, low_precision=False):
    param, grad = flat_tensors(numel)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    grad = grad.bfloat16() if low_precision else grad
    out = torch.empty(numel, dtype=torch.bfloat16) if low_precision else None
    steps = [0]

    def step():
        steps[0] += 1
        adamw_update_(param, grad, exp_avg, exp_avg_sq, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                      weight_decay=WD, step=steps[0], param_out=out, kernel=kernel)
    return step, param


def optimizer_step(numel, make):
    value, grad = flat_tensors(numel)
    param = torch.nn.Parameter(value)
    param.grad = grad
    opt = make([param])
    return opt.step, param.detach()


def deepspeed_adam():
    """DeepSpeedCPUAdam's constructor, or None with the reason it cannot run here."""
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])  # builds the C++ op (once, cached)
    except Exception as e:  # not installed, or the op does not build on this machine
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return (lambda params: DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                             adamw_mode=True)), None


def runs(numel):
    found = {
        "offload fp32": tiny_zero_step(numel, "fused"),
        "offload bf16": tiny_zero_step(numel, "fused", low_precision=True),
        "tiny_zero torch": tiny_zero_step(numel, "torch"),
    }
    for name, options in (("torch single-tensor", {"foreach": False}), ("torch foreach", {"foreach": True}),
                          ("torch fused", {"fused": True})):
        found[name] = optimizer_step(numel, lambda p, o=options: torch.optim.AdamW(p, lr=LR, betas=BETAS, eps=EPS,
                                                                                   weight_decay=WD, **o))
    make, why_not = deepspeed_adam()
    if make is None:
        print(f"DeepSpeedCPUAdam left out: {why_not}")
    else:
        found["DeepSpeedCPUAdam"] = optimizer_step(numel, make)
    return found


def difference(a, b):
    differ = a != b
    return f"{differ.float().mean().item():.2%} differ, by at most {(a - b).abs().max().item():.1e}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=8_000_000, help="parameters in the flat tensor (default: 8,000,000)")
    p.add_argument("--repeat", type=int, default=7, help="timed steps of each AdamW, interleaved (default: 7)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = p.parse_args(argv)
    if args.numel < 1 or args.repeat < 1:
        p.error("--numel and --repeat must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    found = runs(args.numel)
    for step, _ in found.values():
        step()  # warm-up: the moments exist, the thread pool is up
    best = dict.fromkeys(found, float("inf"))
    for _ in range(args.repeat):
        for name, (step, _) in found.items():
            start = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - start)
    base, reference = best["torch single-tensor"], found["torch single-tensor"][1]
    print(f"AdamW step on {args.numel:,} fp32 parameters, {torch.get_num_threads()} threads, "
          f"best of {args.repeat} interleaved; torch {torch.__version__}\n")
    print("| AdamW | ms per million parameters | vs torch single-tensor | parameters after the steps |")
    print("|---|---:|---:|---|")
    for name, seconds in best.items():
        far = {"torch single-tensor": "the reference", "offload bf16": "(bf16 grads)"}.get(name)
        print(f"| {name} | {seconds * 1e9 / args.numel:.2f} | {seconds / base:.2f}x | "
              f"{far or difference(found[name][1], reference)} |")


if __name__ == "__main__":
    main()
