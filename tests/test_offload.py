"""ZeRO-Offload beyond what every strategy is tested for (parity, training-loop
semantics, mixed precision, checkpoints and the memory estimate list it with
the others): the step's kernel, where the state lives, when grads leave the
device, and how many threads the step gets.

On a GPU (skipped without one, with the reason), at world 1 in a process of
its own each: peak GPU memory against zero2 for gpt2 and gpt2-medium in bf16,
parity with torch on CUDA, the state in pinned host memory. All of them:

    python -m pytest tests/test_offload.py -q -rs -k cuda
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import ROOT, run_checks  # noqa: E402

from tiny_zero.optim import AdamW, adamw_update_  # noqa: E402

NO_GPU = "no CUDA device: offload's copies, pinned memory and GPU peak memory are checked only on a GPU"


# ---------------------------------------------------------------- the step's kernel

def adamw_runs(kernel_or_options, steps=20):
    """Parameters of four odd shapes in two groups after `steps` AdamW steps:
    tiny_zero's AdamW with a kernel (a str), or torch.optim.AdamW (a dict of options)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).requires_grad_() for s in [(1,), (7, 3), (1001,), (16, 5)]]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-2, "weight_decay": 0.0}]
    if isinstance(kernel_or_options, str):
        opt = AdamW(groups, lr=1e-2, weight_decay=0.1, kernel=kernel_or_options)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, **kernel_or_options)
    grads = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads) * 1e-2
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


def test_fused_kernel_is_torchs_fused_adamw_bit_for_bit():
    assert torch.equal(adamw_runs("fused"), adamw_runs({"fused": True}))


def test_fused_kernel_rounds_within_an_ulp_of_the_reference():
    """Against torch.optim.AdamW(foreach=False), which tiny_zero's torch path
    equals bit for bit: some elements one rounding apart per step, how many
    depending on the CPU's vector instructions (about 1 in 10 after 20 steps
    on an AVX2 CPU, fewer with AVX-512); most equal."""
    fused, reference = adamw_runs("fused"), adamw_runs({"foreach": False})
    assert torch.equal(adamw_runs("torch"), reference)
    assert torch.allclose(fused, reference, rtol=1e-6, atol=1e-7), (fused - reference).abs().max()
    assert (fused != reference).float().mean() < 0.25


def test_fused_kernel_with_a_bf16_grad_scale_and_copy_out(monkeypatch):
    """What ZeroOffloadAdamW passes under bf16 and clipping: a bf16 grad,
    grad_scale != 1 (the grad left as it was) and a bf16 param_out, as the
    torch path computes them, block by block."""
    import tiny_zero.optim.fused
    monkeypatch.setattr(tiny_zero.optim.fused, "BLOCK", 4096)
    g = torch.Generator().manual_seed(2)
    n = 70_001  # many blocks, an odd tail
    p0, grad = torch.randn(n, generator=g), (torch.randn(n, generator=g) * 64).bfloat16()
    before = grad.clone()
    results = {}
    for kernel in ("fused", "torch"):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step in (1, 2, 3):
            adamw_update_(p, grad, m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                          step=step, grad_scale=0.25, param_out=out, kernel=kernel)
        results[kernel] = p, m, v, out
    assert torch.equal(grad, before)
    for got, want in zip(results["fused"], results["torch"]):
        assert torch.allclose(got.float(), want.float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(results["fused"][3], results["fused"][0].bfloat16())


# ---------------------------------------------------------------- the wrapper, on CPU

@pytest.fixture(scope="module")
def world2():
    return run_checks(2, "offload_checks", [
        ("fp32", "state_on_the_host", (None,)),
        ("bf16", "state_on_the_host", ("bf16",)),
        ("overlap", "grads_leave_during_backward", ()),
        ("threads", "step_on_every_core", ()),
        ("stage3", "fsdp_state_on_the_host", (False,)),
        ("stage3_params", "fsdp_state_on_the_host", (True,))])


@pytest.mark.parametrize("check", ["fp32", "bf16", "overlap", "threads", "stage3", "stage3_params"])
def test_offload_world_2(world2, check):
    failures = [f for rank in world2[check] for f in rank]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- on a GPU

def cuda_check(*args):
    """tests/offload_cuda_check.py in a process of its own (its own NCCL world
    of one, its own CUDA peak); returns what it prints, as JSON."""
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "offload_cuda_check.py"), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.parametrize("model", ["gpt2", "gpt2-medium"])
def test_cuda_peak_memory_below_zero2(model):
    """World 1, bf16: offload's peak GPU memory (torch.cuda.max_memory_allocated
    over three steps) is zero2's less the optimizer state and the grad shard
    (14Ψ: fp32 masters, exp_avg, exp_avg_sq, bf16 grads), but 1Ψ of slack; after the
    step the GPU holds zero2's less those 14Ψ (to 16 MiB): the bf16
    parameters (and what both allocate alike, cuBLAS's workspaces)."""
    zero2, offload = cuda_check("memory", model, "zero2"), cuda_check("memory", model, "offload")
    numel = offload["numel"]
    print(f"{model}: peak GPU memory zero2 {zero2['peak'] / 2**20:,.0f} MiB, offload {offload['peak'] / 2**20:,.0f} "
          f"MiB; after the step {zero2['after_step'] / 2**20:,.0f} and {offload['after_step'] / 2**20:,.0f} MiB")
    assert offload["peak"] <= zero2["peak"] - 13 * numel, (zero2, offload)
    assert zero2["after_step"] - offload["after_step"] == pytest.approx(14 * numel, abs=2**24), (zero2, offload)
    assert offload["flat_params"] == 2 * numel, offload


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_cuda_parity_and_host_state():
    """World 1 on CUDA: offload, and stage 3's FSDPOffload with and without
    offload_params, equal torch (nn layers, torch.optim.AdamW on the GPU) at
    rtol 1e-5 / atol 1e-6 in the parity modes; the masters, the AdamW state and
    the grads are pinned host tensors, only flat_params (FSDPOffload: the
    slices, or nothing with offload_params) on the GPU."""
    failures = cuda_check("parity")
    assert not failures, "\n".join(failures[:40])
