"""On a GPU: the Triton AdamW kernel against torch.optim.AdamW(fused=True);
every strategy at world 1 over NCCL against plain torch in fp32; bf16
training tracking fp32; steady-state steps that never make the host wait
for the device (torch.cuda.set_sync_debug_mode("error")); the README's
two-rank command on one GPU; and two ranks sharing one GPU over gloo, whose
collectives take CUDA tensors, against torch. Skipped, with the reason,
where there is no GPU."""
import os
import re
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import tiny_zero  # noqa: E402
from example.model import build_model  # noqa: E402
from harness import run_world  # noqa: E402
from parity_checks import ATOL, LR, MODES, PER_RANK, RTOL, STEPS, WD, ParityNet, global_batch, wrap  # noqa: E402
from tiny_zero import comm  # noqa: E402
from tiny_zero.module import swap_layers  # noqa: E402
from tiny_zero.optim import AdamW, adamw_update_  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: these tests need a GPU")
STRATEGIES = list(tiny_zero.STRATEGIES)


@pytest.fixture(scope="module", autouse=True)
def exact_fp32_and_one_process_group():
    """IEEE fp32 matmuls (no TF32), so that rtol 1e-5 holds as on the CPU; and
    the world-1 NCCL group the wrappers create is destroyed afterwards."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(precision)
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- the kernel

@pytest.mark.parametrize("n", [1, 1023, 4097, 65537, 3 * 2**20 + 17])  # tails of any BLOCK up to 4096; many blocks
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_out", [False, True])
def test_triton_kernel_matches_torch_fused_adamw(n, grad_dtype, with_out):
    """5 steps with a scaled low-precision grad; param_out poisoned first."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    p0 = torch.randn(n, device="cuda", generator=gen)
    ours = [p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)]
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, fused=True)
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda") if with_out else None
    for step in range(1, 6):
        grad = (torch.randn(n, device="cuda", generator=gen) * 64).to(grad_dtype)
        ref.grad = grad.float() * (1 / 64)  # the same fp32 products the kernel forms from grad_scale
        opt.step()
        adamw_update_(ours[0], grad, ours[1], ours[2], lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
                      weight_decay=0.1, step=step, grad_scale=1 / 64, param_out=out, kernel="triton")
    state = opt.state[ref]
    for what, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, (ref, state["exp_avg"], state["exp_avg_sq"])):
        torch.testing.assert_close(a, b.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    if with_out:
        assert torch.equal(out, ours[0].bfloat16())  # every element written, rounded as torch rounds
    # The params moved far beyond the tolerance: the comparison above is not vacuous. (Not "every
    # element moved": over millions of elements a few end exactly where they started.)
    assert (ours[0] - p0).abs().mean().item() > 1e-3


def test_triton_kernel_offsets_past_2_to_the_31():
    """Elements beyond 2**31 are updated (an int32 offset would wrap): the
    last ones are checked against the torch path."""
    n, tail = 2**31 + 1031, 4096
    if torch.cuda.mem_get_info()[0] < 4 * 4 * n * 1.1:
        pytest.skip("needs about 38 GB of free GPU memory")
    gen = torch.Generator(device="cuda").manual_seed(0)
    p, g, m, v = (torch.ones(n, device="cuda") for _ in range(4))
    for t in (p, g, m):
        t[-tail:] = torch.randn(tail, device="cuda", generator=gen)
    expected = [t[-tail:].clone() for t in (p, g, m, v)]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3)
    adamw_update_(p, g, m, v, **hyper, kernel="triton")
    adamw_update_(*expected, **hyper, kernel="torch")
    for a, b in zip((p, m, v), (expected[0], expected[2], expected[3])):
        torch.testing.assert_close(a[-tail:], b, rtol=RTOL, atol=ATOL)
    head = [torch.ones(4, device="cuda") for _ in range(4)]
    adamw_update_(*head, **hyper, kernel="torch")
    torch.testing.assert_close(p[:4], head[0], rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------- strategies, fp32

def train_parity_net(mode, name=None):
    """Per step: loss, clip norm, full fp32 state. name=None: plain torch
    (nn layers, torch.optim.AdamW) on the GPU; else that strategy at world 1."""
    eps, clip, micro = MODES[mode]
    torch.manual_seed(0)
    if name is None:
        model = ParityNet().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps, weight_decay=WD)
        backward, no_sync, state = torch.Tensor.backward, nullcontext, model.state_dict
        clip_norm = lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c).item()  # noqa: E731
    else:
        model = wrap(name, ParityNet())
        opt = tiny_zero.STRATEGIES[name][1](model, lr=LR, eps=eps, weight_decay=WD)
        backward, no_sync, state = model.backward, model.no_sync, model.full_state_dict
        clip_norm = lambda c: model.clip_grad_norm_(c).item()  # noqa: E731
        assert dist.get_backend() == "nccl"
    history = []
    for step in range(STEPS):
        loss_sum = 0.0
        for m in range(micro):
            x, y = (t.cuda() for t in global_batch(step, m, 1))
            with no_sync() if m < micro - 1 else nullcontext():
                loss = model(x, y) / micro
                backward(loss)
            loss_sum += loss.item()
        norm = clip_norm(clip) if clip else None
        opt.step()
        opt.zero_grad()
        history.append((loss_sum, norm, {k: v.detach().float().cpu().clone() for k, v in state().items()}))
    return history


@pytest.mark.parametrize("mode", list(MODES))
def test_every_strategy_matches_torch_over_nccl(mode):
    ref = train_parity_net(mode)
    for name in STRATEGIES:
        for step, ((loss, norm, state), (ref_loss, ref_norm, ref_state)) in enumerate(
                zip(train_parity_net(mode, name), ref)):
            where = f"{name}/{mode} step {step}"
            assert loss == pytest.approx(ref_loss, rel=RTOL, abs=ATOL), where
            if norm is not None:
                assert norm == pytest.approx(ref_norm, rel=RTOL, abs=ATOL), where
            for key, value in ref_state.items():
                torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} {key}: {m}")


# ---------------------------------------------------------------- bf16

def train_gpt(name, mixed_precision, steps=12):
    """Losses of the tiny GPT on one repeated batch; and, for a strategy, its full state."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 33), generator=gen).cuda()
    x, y = tokens[:, :-1], tokens[:, 1:]
    module = build_model("tiny")
    if name is None:
        model = module.cuda()
        opt, backward = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.Tensor.backward
    else:
        model = tiny_zero.STRATEGIES[name][0](module, mixed_precision=mixed_precision)
        opt, backward = tiny_zero.STRATEGIES[name][1](model, lr=1e-3), model.backward
    losses = []
    for _ in range(steps):
        loss = model(x, y)
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("name", STRATEGIES)
def test_bf16_tracks_fp32(name):
    """Each step's loss within 2% of plain torch fp32 (the CPU tests allow 5%),
    bf16 weights, fp32 masters in full_state_dict, and the loss falls."""
    ref, _ = train_gpt(None, None)
    losses, model = train_gpt(name, "bf16")
    for step, (loss, ref_loss) in enumerate(zip(losses, ref)):
        assert abs(loss - ref_loss) <= 2e-2 * ref_loss, f"step {step}: bf16 {loss} vs fp32 {ref_loss}"
    assert losses[-1] < losses[0] - 0.3  # it learns the batch
    assert {p.dtype for p in model.module.parameters()} == {torch.bfloat16}
    state = model.full_state_dict()
    assert all(v.dtype == torch.float32 for v in state.values())
    assert not all(torch.equal(v, v.bfloat16().float()) for v in state.values())  # masters, not bf16 values


# ---------------------------------------------------------------- no host wait in a step

PRECISIONS = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# single_device without fp16: tiny_zero.optim.AdamW takes no loss scale (fp16 is a wrapper's mixed_precision)
SYNC_CASES = [(name, precision) for name in STRATEGIES for precision in PRECISIONS] + \
    [("single_device", None), ("single_device", "bf16")]


def syncs_allowed(fn):
    """fn, run with the sync debug mode off: a wait that belongs to the design."""
    def call(*args, **kwargs):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    return call


def steady_steps(name, precision, device="cuda", steps=4, warmup=2):
    """`steps` steps of two micro-batches (the first under no_sync), a clip, the
    step and zero_grad; after `warmup` steps, any call that makes the host wait
    for the device raises (set_sync_debug_mode("error")). Returns the last loss."""
    torch.manual_seed(0)
    batches = [[[t.to(device) for t in global_batch(step, micro, 1)] for micro in range(2)] for step in range(steps)]
    if name == "single_device":  # tiny_zero's layers and AdamW (fp32 masters), no wrapper
        model = ParityNet()
        swap_layers(model)
        model.to(device=device, dtype=PRECISIONS[precision])
        opt = AdamW(model.parameters(), lr=LR)
        backward, no_sync = torch.Tensor.backward, nullcontext
        clip = lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c)  # noqa: E731
    else:
        wrapper_cls, opt_cls = tiny_zero.STRATEGIES[name]
        buckets = {} if name == "fsdp" else {"bucket_bytes": 200}  # several buckets per backward
        model = wrapper_cls(ParityNet(), mixed_precision=precision, **buckets)
        opt = opt_cls(model, lr=LR)
        backward, no_sync, clip = model.backward, model.no_sync, model.clip_grad_norm_
        if name == "offload":  # its host step reads the grads it copied: it waits for those copies, by design
            model.wait_for_copies = syncs_allowed(model.wait_for_copies)
    try:
        for step, micro_batches in enumerate(batches):
            if step == warmup:
                torch.cuda.set_sync_debug_mode("error")
            for micro, (x, y) in enumerate(micro_batches):
                with no_sync() if micro == 0 else nullcontext():
                    loss = model(x, y)
                    backward(loss)
            clip(1.0)
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return loss.item()


@pytest.mark.parametrize("name,precision", SYNC_CASES)
def test_steady_steps_never_wait_for_the_device(name, precision):
    loss = steady_steps(name, precision)
    assert 0 < loss < 10, loss  # it trained: the steps were not vacuous


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_torch_loop_never_waits_for_the_device(precision):
    """The control: torch's own loop (clip_grad_norm_, AdamW(fused=True),
    GradScaler) passes under the same mode, and a .item() in it fails."""
    torch.manual_seed(0)
    model = ParityNet().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    x, y = (t.cuda() for t in global_batch(0, 0, 1))

    def step():
        with torch.autocast("cuda", dtype=PRECISIONS[precision], enabled=precision is not None):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss
    step(), step()
    try:
        torch.cuda.set_sync_debug_mode("error")
        loss = step()
        with pytest.raises(RuntimeError, match="synchroniz"):
            loss.item()
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ---------------------------------------------------------------- more ranks than GPUs

def test_two_ranks_on_one_gpu_train_on_the_cpu_and_say_so():
    """The README's `torchrun --nproc_per_node 2 example/zero3/train.py` on a
    machine with one GPU: both ranks run on the CPU with gloo, local rank 0
    says so in one line, and the run trains and exits 0."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "example" / "zero3" / "train.py"), "--model", "tiny", "--seq-len", "32", "--batch-size", "2",
         "--eval-batches", "0", "--steps", "3"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("tiny_zero: ")]
    assert said == ["tiny_zero: 2 ranks on this machine but 1 GPU(s) visible: every rank runs on the CPU with "
                    "gloo (start at most 1 ranks per machine to train on the GPUs)"], result.stderr[-3000:]
    assert len(re.findall(r"^step \d+ loss \S+$", result.stdout, re.MULTILINE)) == 3, result.stdout


# ---------------------------------------------------------------- two ranks on one GPU over gloo

GLOO_MODES = ["plain", "clip", "no_sync"]


def collectives_gloo_runs(device):
    """{kind: True where this torch's gloo runs tiny_zero.comm's collective of
    that kind on tensors of `device`, with the right result}. torch's docs list
    all_reduce, broadcast, reduce, all_gather and reduce_scatter for gloo on
    GPUs in recent releases (older ones only all_reduce and broadcast), send and
    recv never: each is tried here once, on a small tensor."""
    world, rank = dist.get_world_size(), dist.get_rank()
    total = world * (world + 1) / 2  # the sum of every rank's rank + 1
    mine = lambda: torch.full((2 * world,), rank + 1.0, device=device)  # noqa: E731
    gathered = torch.arange(1, world + 1.0, device=device).repeat_interleave(2)
    chunk = torch.empty(2, device=device)

    def all_gather(t):
        comm._all_gather(t, mine()[:2])
        return t.equal(gathered)

    def reduce_scatter(t):
        comm._reduce_scatter(chunk, t)
        return chunk.eq(total).all().item()
    tries = {
        "all_reduce": lambda t: (dist.all_reduce(t), t.eq(total).all().item())[1],
        "broadcast": lambda t: (dist.broadcast(t, 0), t.eq(1).all().item())[1],
        "reduce": lambda t: (dist.reduce(t, 0), rank != 0 or t.eq(total).all().item())[1],  # elsewhere: scratch
        "all_gather": all_gather,
        "reduce_scatter": reduce_scatter,
    }
    runs = {}
    for kind, attempt in tries.items():
        try:
            runs[kind] = bool(attempt(mine()))
        except Exception as e:  # gloo refuses a device it does not handle before it sends anything
            runs[kind] = False
            print(f"gloo on {device}, {kind}: {str(e).splitlines()[0]}", file=sys.stderr)
    everyone = [None] * world
    dist.all_gather_object(everyone, runs)
    return {kind: all(r[kind] for r in everyone) for kind in runs}  # the ranks must choose alike


def reference_on(device, mode, world):
    """Plain torch on `device`, one process, the concatenated batch: per step
    the loss, the clip norm and the parameters (on the CPU)."""
    eps, clip, micro = MODES[mode]
    torch.manual_seed(0)
    model = ParityNet().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps, weight_decay=WD)
    history = []
    for step in range(STEPS):
        loss_sum = 0.0
        for m in range(micro):
            loss = model(*(t.to(device) for t in global_batch(step, m, world))) / micro
            loss.backward()
            loss_sum += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() if clip else None
        opt.step()
        opt.zero_grad()
        history.append((loss_sum, norm, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}))
    return history


def parity_on(device, name, mode, ref):
    """One strategy with every rank on `device`, against the reference; returns failures."""
    eps, clip, micro = MODES[mode]
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    wrapper_cls, opt_cls = tiny_zero.STRATEGIES[name]
    buckets = {} if name == "fsdp" else {"bucket_bytes": 200}
    model = wrapper_cls(ParityNet(), device=device, **buckets)
    opt = opt_cls(model, lr=LR, eps=eps, weight_decay=WD)
    failures = []
    where = f"{name}/{mode} over gloo on {device}"
    if not all(p.device == torch.device(device) for p in model.module.parameters()):
        failures.append(f"{where}: the module is not on {device}")
    for step in range(STEPS):
        loss_sum = torch.zeros((), device=device)
        for m in range(micro):
            x, y = (t[rank * PER_RANK:(rank + 1) * PER_RANK].to(device) for t in global_batch(step, m, world))
            with model.no_sync() if m < micro - 1 else nullcontext():
                loss = model(x, y) / micro
                model.backward(loss)
            loss_sum += loss.detach()
        norm = model.clip_grad_norm_(clip) if clip else None
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss_sum)
        ref_loss, ref_norm, ref_state = ref[step]
        at = f"{where}, step {step}"
        if abs(loss_sum.item() / world - ref_loss) > ATOL + RTOL * abs(ref_loss):
            failures.append(f"{at}: loss {loss_sum.item() / world} vs torch {ref_loss}")
        if clip and abs(norm.item() - ref_norm) > ATOL + RTOL * ref_norm:
            failures.append(f"{at}: clip norm {norm.item()} vs torch {ref_norm}")
        state = {key: value.cpu() for key, value in model.full_state_dict().items()}
        for key, value in ref_state.items():
            if not torch.allclose(state[key], value, rtol=RTOL, atol=ATOL):
                failures.append(f"{at}: {key} differs by {(state[key] - value).abs().max().item():.2e}")
    return failures


def collectives_sent(name):
    """The kinds of collective a strategy's training sends (a step with
    accumulation and a clip, and full_state_dict), counted on the CPU."""
    comm.stats.reset()
    wrapper_cls, opt_cls = tiny_zero.STRATEGIES[name]
    model = wrapper_cls(ParityNet(), device="cpu")
    opt = opt_cls(model, lr=LR)
    for micro in range(2):
        with model.no_sync() if micro == 0 else nullcontext():
            model.backward(model(*(t[:PER_RANK] for t in global_batch(0, micro, 1))))
    model.clip_grad_norm_(1.0)
    opt.step()
    model.full_state_dict()
    return set(comm.stats.calls)


def gloo_ranks_sharing(device, names, modes):
    """Worker (gloo ranks, all on one `device`): which collectives gloo runs
    there; then each strategy whose training sends only those, against torch.
    Returns {strategy: its failures, or why it was skipped}."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
    torch.set_float32_matmul_precision("highest")
    runs = collectives_gloo_runs(device)
    refs = {mode: reference_on(device, mode, dist.get_world_size()) for mode in modes}
    results = {}
    for name in names:
        missing = sorted(kind for kind in collectives_sent(name) if not runs.get(kind))
        if missing:
            results[name] = (f"its training sends {', '.join(missing)}, which gloo in torch {torch.__version__} "
                             f"does not run on {device} tensors")
        else:
            results[name] = [failure for mode in modes for failure in parity_on(device, name, mode, refs[mode])]
    return results


@pytest.fixture(scope="module")
def gloo_results():
    return run_world(2, "test_cuda", "gloo_ranks_sharing", "cuda:0", STRATEGIES, GLOO_MODES, timeout=300)


@pytest.mark.parametrize("name", STRATEGIES)
def test_two_gloo_ranks_sharing_one_gpu_match_torch(gloo_results, name):
    """The strategies' streams, waits and frees, with collectives that really
    run beside the compute on CUDA tensors: gloo copies them to the host on
    its own stream, and wait() makes the current stream wait for it."""
    result = gloo_results[0][name]
    if isinstance(result, str):
        pytest.skip(result)
    assert not result and not gloo_results[1][name], "\n".join(result + gloo_results[1][name])
