"""Tests for tiny_zero.optim: AdamW against torch.optim.AdamW, on the torch path, the Triton kernel
(in Triton's CPU interpreter, and on CUDA when present), state_dict round-trips, fp32 masters for
low-precision params, argument checking and lazy triton import."""

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tiny_zero.optim import AdamW, adamw_update_

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(1,), (7, 3), (101,), (16, 5)]  # a 1-element and odd-sized tensors


def make_params(seed, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_() for s in SHAPES]


def two_groups(params):
    """Two param groups with different lr, weight_decay and shapes."""
    return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-2, "weight_decay": 0.2}]


def set_grads(params_lists, gen):
    """Give each parameter in every list the same fresh random grad (shape of the first list's param)."""
    for ps in zip(*params_lists):
        grad = torch.randn(ps[0].shape, generator=gen)
        for p in ps:
            p.grad = grad.to(device=p.device, dtype=p.dtype, copy=True)


def assert_tracks_torch_adamw(kernel, device, steps=20, tol=1e-6):
    ours, ref = make_params(0, device), make_params(0, device)
    opt = AdamW(two_groups(ours), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05, kernel=kernel)
    ref_opt = torch.optim.AdamW(two_groups(ref), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        set_grads([ours, ref], gen)
        opt.step()
        ref_opt.step()
        for i, (p, q) in enumerate(zip(ours, ref)):
            diff = (p - q).abs().max().item()
            assert diff <= tol, f"step {step}, param {i} {tuple(p.shape)}: max abs diff {diff}"
    # The parameters did move, so the comparison above is not comparing untouched tensors.
    start = make_params(0, device)
    assert all((p - s).abs().max().item() > 1e-2 for p, s in zip(ours, start))


def test_torch_path_matches_torch_adamw():
    assert_tracks_torch_adamw("torch", "cpu")



def test_cpu_fp32_params_stepped_together_equal_torch_bitwise():
    """On the CPU, AdamW steps a group's fp32 parameters at once over their flat buffer: bitwise
    torch.optim.AdamW, each parameter with its own step count (one skips steps: grad None), next
    to a bf16 parameter in a group of its own."""
    ours, ref = make_params(3), make_params(3)
    start = torch.randn(6, generator=torch.Generator().manual_seed(4)).bfloat16()
    low, low_ref = start.clone().requires_grad_(), start.clone().requires_grad_()
    opt = AdamW(two_groups(ours) + [{"params": [low]}], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)
    ref_opt = torch.optim.AdamW(two_groups(ref) + [{"params": [low_ref]}], lr=1e-2, betas=(0.9, 0.99),
                                weight_decay=0.05)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        set_grads([ours + [low], ref + [low_ref]], gen)
        if step % 2:
            ours[1].grad = ref[1].grad = None  # this one keeps its step count
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        assert torch.equal(p, q)
    assert opt.state[ours[1]]["step"] == 3 and opt.state[ours[0]]["step"] == 6
    assert torch.allclose(low.float(), low_ref.float(), rtol=2 ** -6, atol=0)  # bf16: within 2 ulps (our fp32 master)
    assert not torch.equal(low.detach(), start)  # it was stepped


def test_triton_kernel_matches_torch_adamw_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the compiled Triton kernel is checked only on a GPU")
    pytest.importorskip("triton")
    assert_tracks_torch_adamw("triton", "cuda")
    assert_tracks_torch_adamw("auto", "cuda")
    # Large enough for many programs, odd tail; low-precision grad and param_out.
    flat_update_case(n=3 * 1024 * 1024 + 17, device="cuda")
    flat_update_case(n=1024 + 17, device="cuda", scale_on_device=True)


def flat_update_case(n, device, kernel="triton", scale_on_device=False):
    """adamw_update_ with a bf16 grad, grad_scale != 1 and a bf16 param_out vs the torch path;
    scale_on_device: grad_scale a 0-d tensor (a clip coefficient the host never reads)."""
    g = torch.Generator().manual_seed(2)
    p0, m0 = torch.randn(n, generator=g) * 0.5, torch.randn(n, generator=g) * 0.1  # |p| < 4: fp32 ulp < 1e-6
    v0, grad = torch.rand(n, generator=g) * 0.01, torch.randn(n, generator=g) * 64
    results = {}
    for name in (kernel, "torch"):
        p, m, v = (t.clone().to(device) for t in (p0, m0, v0))
        out = torch.empty(n, dtype=torch.bfloat16, device=device)
        scale = torch.tensor(1 / 64, device=device) if scale_on_device else 1 / 64
        for step in (1, 2, 3):
            adamw_update_(p, grad.to(device, torch.bfloat16), m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.1, step=step, grad_scale=scale, param_out=out, kernel=name)
        results[name] = (p, m, v, out)
    for what, a, b in zip(("param", "exp_avg", "exp_avg_sq"), results[kernel], results["torch"]):
        assert (a - b).abs().max().item() <= 1e-6, what
    # bf16 output: param_out is the kernel's own fp32 param, rounded to nearest-even as torch rounds.
    # Triton's CPU interpreter rounds fp32 -> bf16 toward zero instead (compiled code rounds to nearest
    # even), so there either rounding of the kernel's param is accepted; on CUDA only the torch one.
    p_k, out_k = results[kernel][0], results[kernel][3]
    assert torch.equal(results["torch"][3], results["torch"][0].bfloat16())
    toward_zero = (p_k.view(torch.int32) & -65536).view(torch.float32).bfloat16()  # drop the low 16 bits
    assert torch.equal(out_k, p_k.bfloat16()) or (device == "cpu" and torch.equal(out_k, toward_zero))
    # The params moved far beyond the tolerance, so the comparison is not vacuous. (Not "every
    # element moved": over the 3M elements of the CUDA case a few end exactly where they started.)
    assert (results["torch"][0] - p0.to(device)).abs().mean().item() > 1e-3


def run_python(code, **env):
    """Run `code` in a fresh interpreter with extra environment variables; return its stdout."""
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_triton_kernel_in_interpreter():
    """TRITON_INTERPRET=1 must be set before triton decorates the kernel, hence a subprocess."""
    pytest.importorskip("triton")
    out = run_python("""
        import json
        import tests.test_optim as t
        from tiny_zero.optim import kernel
        t.SHAPES[:] = [(1,), (7, 3), (kernel.BLOCK + 5,)]  # tail not a multiple of BLOCK
        t.assert_tracks_torch_adamw("triton", "cpu", steps=20)
        t.flat_update_case(n=2 * kernel.BLOCK + 3, device="cpu")
        t.flat_update_case(n=kernel.BLOCK + 3, device="cpu", scale_on_device=True)
        print(json.dumps({"ok": True, "block": kernel.BLOCK}))
    """, TRITON_INTERPRET="1")
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"] and result["block"] > 1


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p, g, m, v = (torch.zeros(4) for _ in range(4))
    with pytest.raises(RuntimeError, match="CUDA.*TRITON_INTERPRET=1"):
        adamw_update_(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                      kernel="triton")


@pytest.mark.slow
def test_import_and_torch_path_work_without_triton():
    """With `import triton` failing, tiny_zero.optim imports and kernel="auto" runs on the torch path."""
    out = run_python("""
        import sys, torch

        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton blocked for this test")

        sys.meta_path.insert(0, NoTriton())
        import tiny_zero.optim
        p = torch.ones(3, requires_grad=True)
        p.grad = torch.ones(3)
        tiny_zero.optim.AdamW([p], lr=0.1, weight_decay=0.0).step()
        print("kernel module loaded:", "tiny_zero.optim.kernel" in sys.modules, "p:", p.tolist())
    """)
    # First step of Adam moves each weight by lr (up to eps): 1 - 0.1.
    assert "kernel module loaded: False" in out
    p = json.loads(out.split("p:")[1])
    assert p == pytest.approx([0.9] * 3, abs=1e-6)


def test_state_dict_round_trip_is_bit_identical():
    params = make_params(3) + [torch.randn(9, 4).bfloat16().requires_grad_()]  # a bf16 param: master in state
    opt = AdamW(two_groups(params), lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    for _ in range(5):
        set_grads([params], gen)
        opt.step()

    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    clones = [p.detach().clone().requires_grad_() for p in params]
    resumed = AdamW(two_groups(clones), lr=1.0)  # lr differs on purpose: the state dict must restore it
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))

    state = resumed.state[clones[-1]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", "master"} and state["step"] == 5
    assert state["master"].dtype == state["exp_avg"].dtype == torch.float32
    assert set(resumed.state[clones[0]]) == {"step", "exp_avg", "exp_avg_sq"}  # fp32: no master copy

    for _ in range(5):
        set_grads([params, clones], gen)
        opt.step()
        resumed.step()
    for p, q in zip(params, clones):
        assert torch.equal(p, q)
    assert torch.equal(opt.state[params[-1]]["master"], resumed.state[clones[-1]]["master"])


def test_loads_torch_adamw_state_dict():
    """Same state layout as torch.optim.AdamW: its checkpoint resumes in ours and continues identically."""
    ours, ref = make_params(5), make_params(5)
    ref_opt = torch.optim.AdamW(two_groups(ref), lr=1e-2)
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        set_grads([ref], gen)
        ref_opt.step()
    with torch.no_grad():
        for p, q in zip(ours, ref):
            p.copy_(q)
    opt = AdamW(two_groups(ours), lr=1e-2)
    buffer = io.BytesIO()
    torch.save(ref_opt.state_dict(), buffer)
    buffer.seek(0)
    opt.load_state_dict(torch.load(buffer))
    for _ in range(3):
        set_grads([ours, ref], gen)
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        assert (p - q).abs().max().item() <= 1e-6


def test_torch_options_it_lacks_are_refused_not_ignored():
    """amsgrad and maximize, which torch.optim.AdamW has and this AdamW does not,
    raise in a group (constructor, add_param_group) and in a checkpoint of a
    torch.optim.AdamW that used one (at the step), rather than being ignored."""
    params = make_params(0)
    with pytest.raises(ValueError, match="has no amsgrad"):
        AdamW([{"params": params[:2]}, {"params": params[2:], "amsgrad": True}])
    opt = AdamW(params[:2])
    with pytest.raises(ValueError, match="has no maximize"):
        opt.add_param_group({"params": params[2:], "maximize": True})
    ref = make_params(0)
    ref_opt = torch.optim.AdamW(ref, amsgrad=True)
    set_grads([ref], torch.Generator().manual_seed(0))
    ref_opt.step()
    opt = AdamW(params)
    opt.load_state_dict(ref_opt.state_dict())
    set_grads([params], torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="has no amsgrad"):
        opt.step()


def test_bf16_params_use_fp32_master_and_track_fp32_run():
    # Weights near 1 with lr 1e-3: a bf16-only update (bf16 spacing near 1 is 2**-7) would mostly round away.
    g = torch.Generator().manual_seed(7)
    init = [(torch.randn(s, generator=g) + 1.0).bfloat16().float() for s in [(64, 3), (5,)]]  # same start
    fp32 = [t.clone().requires_grad_() for t in init]
    bf16 = [t.bfloat16().requires_grad_() for t in init]
    plain_bf16 = [t.bfloat16().requires_grad_() for t in init]  # torch's AdamW, no master copy
    opts = [AdamW(fp32, lr=1e-3), AdamW(bf16, lr=1e-3), torch.optim.AdamW(plain_bf16, lr=1e-3)]
    gen = torch.Generator().manual_seed(8)
    for _ in range(20):
        for p32, p16, q16 in zip(fp32, bf16, plain_bf16):
            grad = torch.randn(p32.shape, generator=gen) + 1.0  # a drift, so the weights move steadily
            p32.grad, p16.grad, q16.grad = grad, grad.bfloat16(), grad.bfloat16()
        for opt in opts:
            opt.step()
    for p32, p16, q16, start in zip(fp32, bf16, plain_bf16, init):
        master = opts[1].state[p16]["master"]
        assert master.dtype == opts[1].state[p16]["exp_avg"].dtype == torch.float32
        assert p16.dtype == torch.bfloat16
        assert torch.equal(p16, master.bfloat16())  # param written back from the master, rounded
        assert (p32 - start).abs().mean().item() > 1e-2  # the run moved the weights
        assert (master - p32).abs().max().item() < 1e-4  # and the master followed the fp32 run
        assert (q16.float() - p32).abs().max().item() > 1e-3  # which a bf16-only AdamW does not
    assert "master" not in opts[0].state[fp32[0]]  # fp32 params are stepped in place


def test_grad_scale_attribute_scales_grads():
    a, b = make_params(9), make_params(9)
    opt_a, opt_b = AdamW(a, lr=1e-2, eps=1e-3), AdamW(b, lr=1e-2, eps=1e-3)  # large eps: scale-sensitive
    opt_b.grad_scale = 0.25
    gen = torch.Generator().manual_seed(10)
    for _ in range(3):
        set_grads([a, b], gen)
        for p in a:
            p.grad.mul_(0.25)
        opt_a.step()
        opt_b.step()
    assert opt_b.grad_scale == 0.25  # not reset by step
    for p, q in zip(a, b):
        assert (p - q).abs().max().item() <= 1e-6
    # Unscaled grads give a different result, so the check above is sensitive to grad_scale.
    c = make_params(9)
    opt_c = AdamW(c, lr=1e-2, eps=1e-3)
    gen = torch.Generator().manual_seed(10)
    for _ in range(3):
        set_grads([c], gen)
        opt_c.step()
    assert max((p - q).abs().max().item() for p, q in zip(a, c)) > 1e-4


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1e-3), "learning rate"),
    (dict(betas=(1.0, 0.999)), "beta parameter at index 0"),
    (dict(betas=(0.9, -0.1)), "beta parameter at index 1"),
    (dict(eps=-1e-8), "epsilon"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(kernel="cuda"), "unknown kernel"),
])
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamW(make_params(0), **kwargs)


def test_bad_group_and_update_arguments_raise():
    params = make_params(0)
    with pytest.raises(ValueError, match="learning rate"):
        AdamW([{"params": params[:1]}, {"params": params[1:], "lr": -1.0}])
    p, g, m, v = (torch.zeros(4) for _ in range(4))
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="unknown kernel"):
        adamw_update_(p, g, m, v, **hp, step=1, kernel="cuda")
    with pytest.raises(ValueError, match="step"):
        adamw_update_(p, g, m, v, **hp, step=0)
    with pytest.raises(ValueError, match="equal numel"):
        adamw_update_(p, torch.zeros(5), m, v, **hp, step=1)
    with pytest.raises(ValueError, match="fp32"):
        adamw_update_(p.half(), g, m, v, **hp, step=1)


def test_a_bf16_parameter_written_in_place_keeps_the_write():
    """torch.optim steps the parameter itself, so a write into it (a pruning
    mask, a zeroed bias) lasts; tiny_zero's AdamW steps an fp32 master of a
    bf16 parameter, which takes the elements the write changed, and keeps its
    own precision in the others, before the step would write the old ones
    back. Against the same write made into the masters themselves."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    mask = torch.arange(64).view(8, 8) % 3 != 0
    runs = []
    for into_master in (False, True):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8).bfloat16()
        opt = AdamW(lin.parameters(), lr=1e-2)
        for step in range(2):
            lin(x).float().square().sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 0 and into_master:
                opt.state[lin.weight]["master"].mul_(mask)
                opt.state[lin.bias]["master"].zero_()
            if step == 0:
                with torch.no_grad():
                    lin.weight.mul_(mask)
                    torch.nn.init.zeros_(lin.bias)
        runs.append([opt.state[p]["master"] for p in (lin.weight, lin.bias)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert runs[0][0][~mask].abs().max() <= 1e-2 * 1.001  # one AdamW step from 0


def skip_and_step_in_memory_case(n, device, kernel):
    """fp16's arguments, on the device: found_inf nonzero writes nothing (param,
    moments, param_out bit-unchanged, even with inf/nan grads); a step count
    read from a 0-d tensor (STEP_IN_MEMORY on Triton) steps as the host's
    number does; found_inf zero changes nothing."""
    g = torch.Generator().manual_seed(3)
    p0, m0 = torch.randn(n, generator=g) * 0.5, torch.randn(n, generator=g) * 0.1
    v0, grad = torch.rand(n, generator=g) * 0.01, torch.randn(n, generator=g)
    bad = grad.clone()
    bad[::3] = float("inf")
    bad[1::3] = float("nan")
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    results = []
    for in_memory in (False, True):
        p, m, v = (t.clone().to(device) for t in (p0, m0, v0))
        out = torch.zeros(n, dtype=torch.float16, device=device)
        count = torch.zeros((), device=device)
        for step, found in ((1, 0.0), (2, 1.0), (2, 0.0), (3, 1.0), (3, 0.0)):
            count.fill_(step)
            before = [t.clone() for t in (p, m, v, out)]
            adamw_update_(p, (bad if found else grad).to(device, torch.float16), m, v, **hp,
                          step=count if in_memory else step, grad_scale=torch.tensor(0.5, device=device),
                          param_out=out, kernel=kernel, found_inf=torch.tensor(found, device=device))
            if found:
                assert all(torch.equal(a, b) for a, b in zip(before, (p, m, v, out))), (kernel, step)
            else:
                assert not torch.equal(before[0], p), (kernel, step)
        results.append((p, m, v))
    p, m, v = (t.clone().to(device) for t in (p0, m0, v0))  # the same three steps, with no found_inf at all
    for step in (1, 2, 3):
        adamw_update_(p, grad.to(device, torch.float16), m, v, **hp, step=step, grad_scale=0.5, kernel="torch")
    for ours in results:
        for what, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, (p, m, v)):
            assert (a - b).abs().max().item() <= 1e-6, (kernel, what)


@pytest.mark.parametrize("kernel", ["torch", "fused"])
def test_found_inf_and_step_in_memory(kernel):
    skip_and_step_in_memory_case(37, "cpu", kernel)


@pytest.mark.slow
def test_found_inf_and_step_in_memory_triton():
    """In Triton's interpreter (a subprocess, as above) and, where there is one, on a GPU."""
    pytest.importorskip("triton")
    run_python("""
        import tests.test_optim as t
        from tiny_zero.optim import kernel
        t.skip_and_step_in_memory_case(kernel.BLOCK + 3, "cpu", "triton")
    """, TRITON_INTERPRET="1")
    if torch.cuda.is_available():
        skip_and_step_in_memory_case(3 * 1024 + 17, "cuda", "triton")
