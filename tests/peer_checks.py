"""Worker functions for the peer parity tests (run on every rank of one world).

tiny_zero's five strategies and their peers train parity_checks.ParityNet
(tied weights, layers used twice, bias=False, odd sizes) on the same per-rank
batches with the same fp32 AdamW. The peers:

    torch_ddp        torch.nn.parallel.DistributedDataParallel
    torch_fsdp2      torch.distributed.fsdp.fully_shard, one unit per layer
    deepspeed_zero1  deepspeed.initialize, ZeRO stage 1 (also 2 and 3), with
                     DS_ACCELERATOR=cpu, gloo, and torch.optim.AdamW inside
                     ("torch_adam": true: no C++ op to build)

After every step each peer's loss (mean over ranks), clip norm and full
parameters, each gathered the peer's own way, are compared with every
tiny_zero strategy's at rtol 1e-5 / atol 1e-6.
"""
import os
from contextlib import nullcontext
from types import SimpleNamespace

os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is imported; these worlds are CPU + gloo

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import tiny_zero
from parity_checks import ATOL, LR, MODES, PER_RANK, RTOL, STEPS, WD, ParityNet, global_batch, wrap

STRATEGIES = list(tiny_zero.STRATEGIES)
NAMES = [name for name, _ in ParityNet().named_parameters()]  # the tied head.weight is emb.weight
BUCKET_BYTES = 200  # several buckets even on this small model, for tiny_zero and DeepSpeed alike


def import_deepspeed():
    """deepspeed, ready for CPU; or the reason it cannot be used (a str)."""
    try:
        import deepspeed
        import deepspeed.ops
        import deepspeed.utils
    except Exception as e:  # not installed, or broken: the tests say which
        return f"deepspeed is not importable: {type(e).__name__}: {e}"
    deepspeed.utils.logger.setLevel("WARNING")
    # Its process-group wrapper JIT-compiles a shared-memory all-reduce (~60 s on
    # 2 cores) that only inference and tensor parallelism use; training never does.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def my_batch(step, micro):
    rank, world = dist.get_rank(), dist.get_world_size()
    return [t[rank * PER_RANK:(rank + 1) * PER_RANK] for t in global_batch(step, micro, world)]


def record(loss_sum, norm, params):
    """One step: the loss averaged over ranks, the clip norm, the full params."""
    loss = loss_sum.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size(), norm, {n: params[n].detach().float().cpu().clone() for n in NAMES}


# ---------------------------------------------------------------- runs
# Each returns its history: [(loss, clip norm or None, {name: full param})] per step.

def run_tiny_zero(name, mode):
    eps, clip, micro = MODES[mode]
    torch.manual_seed(0)
    model = wrap(name, ParityNet(), bucket_bytes=BUCKET_BYTES)
    opt = tiny_zero.STRATEGIES[name][1](model, lr=LR, eps=eps, weight_decay=WD)
    history = []
    for step in range(STEPS):
        loss_sum = torch.zeros(())
        for m in range(micro):
            with model.no_sync() if m < micro - 1 else nullcontext():
                loss = model(*my_batch(step, m)) / micro
                model.backward(loss)
            loss_sum += loss.detach()
        norm = model.clip_grad_norm_(clip) if clip else None
        opt.step()
        opt.zero_grad()
        history.append(record(loss_sum, norm, model.full_state_dict()))
    return history


def run_torch_ddp(mode):
    eps, clip, micro = MODES[mode]
    torch.manual_seed(0)
    module = ParityNet()
    model = DistributedDataParallel(module)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps, weight_decay=WD)
    history = []
    for step in range(STEPS):
        loss_sum = torch.zeros(())
        for m in range(micro):
            with model.no_sync() if m < micro - 1 else nullcontext():
                loss = model(*my_batch(step, m)) / micro
                loss.backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() if clip else None
        opt.step()
        opt.zero_grad()
        history.append(record(loss_sum, norm, dict(module.named_parameters())))
    return history


def run_torch_fsdp2(mode):
    eps, clip, micro = MODES[mode]
    torch.manual_seed(0)  # the same seed on every rank: fully_shard does not broadcast
    module = ParityNet()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (module.ln, module.fc1, module.fc2):
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)  # the root's unit: emb and the head tied to it
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=eps, weight_decay=WD)
    history = []
    for step in range(STEPS):
        loss_sum = torch.zeros(())
        for m in range(micro):
            module.set_requires_gradient_sync(m == micro - 1)
            loss = module(*my_batch(step, m)) / micro
            loss.backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), clip).full_tensor().item() if clip else None
        opt.step()
        opt.zero_grad()
        history.append(record(loss_sum, norm, {n: p.full_tensor() for n, p in module.named_parameters()}))
    return history


def deepspeed_config(stage, eps=1e-8, clip=None, micro=1, bucket_bytes=BUCKET_BYTES, per_rank=PER_RANK):
    """fp32 ZeRO `stage` with torch.optim.AdamW inside, buckets of bucket_bytes
    (DeepSpeed counts them in elements), and nothing kept gathered in stage 3."""
    elements = bucket_bytes // 4
    return {
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": micro,
        "gradient_clipping": clip or 0.0,  # DeepSpeed clips at 1.0 unless told otherwise
        "steps_per_print": 2**31,
        "optimizer": {"type": "AdamW", "params": {
            "lr": LR, "betas": [0.9, 0.999], "eps": eps, "weight_decay": WD,
            "torch_adam": True,  # torch.optim.AdamW, not DeepSpeed's C++ Adam (a 50 s build)
        }},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": elements,
            "allgather_bucket_size": elements,
            "stage3_prefetch_bucket_size": elements,
            "stage3_max_live_parameters": elements,
            "stage3_param_persistence_threshold": 0,  # shard every tensor, however small
            "stage3_max_reuse_distance": 0,  # release every gathered tensor after use
        },
    }


def run_deepspeed(deepspeed, stage, mode):
    eps, clip, micro = MODES[mode]
    torch.manual_seed(0)
    module = ParityNet()
    linear = F.linear
    engine, optimizer, _, _ = deepspeed.initialize(
        model=module, model_parameters=module.parameters(),
        config=deepspeed_config(stage, eps=eps, clip=clip, micro=micro))
    inner = optimizer.optimizer
    if type(inner) is not torch.optim.AdamW or not inner.defaults["weight_decay"] == WD:
        raise RuntimeError(f"deepspeed stage {stage} built {type(inner)} {inner.defaults}, not torch AdamW")
    history = []
    try:
        for step in range(STEPS):
            loss_sum = torch.zeros(())
            for m in range(micro):
                loss = engine(*my_batch(step, m))
                engine.backward(loss)  # divides by gradient_accumulation_steps itself
                engine.step()  # steps (and zeroes the grads) after the last micro-batch only
                loss_sum += loss.detach() / micro
            norm = float(engine.get_global_grad_norm()) if clip else None
            full = {n: deepspeed.utils.safe_get_full_fp32_param(p) for n, p in module.named_parameters()}
            history.append(record(loss_sum, norm, full))
    finally:
        if hasattr(engine, "destroy"):  # older DeepSpeed has none
            engine.destroy()
        F.linear = linear  # stage 3 swaps in its own torch.nn.functional.linear, for good
    return history


# ---------------------------------------------------------------- compare
def differences(peer, strategy, mode, theirs, ours):
    """Failures (str) and the largest loss and parameter differences."""
    failures, loss_diff, param_diff = [], 0.0, 0.0
    for step, ((loss, norm, params), (our_loss, our_norm, our_params)) in enumerate(zip(theirs, ours)):
        where = f"{peer} vs tiny_zero {strategy}, {mode}, step {step}"
        loss_diff = max(loss_diff, abs(loss - our_loss))
        if abs(our_loss - loss) > ATOL + RTOL * abs(loss):
            failures.append(f"{where}: loss {our_loss} vs {loss}")
        if (norm is None) != (our_norm is None) or norm is not None and abs(our_norm - norm) > ATOL + RTOL * norm:
            failures.append(f"{where}: clip norm {our_norm} vs {norm}")
        for n in NAMES:
            param_diff = max(param_diff, (our_params[n] - params[n]).abs().max().item())
            if not torch.allclose(our_params[n], params[n], rtol=RTOL, atol=ATOL):
                failures.append(f"{where}: {n} differs by {(our_params[n] - params[n]).abs().max().item():.2e}")
    return failures, loss_diff, param_diff


def peer_parity(peers, modes):
    """Every peer in `peers` against every tiny_zero strategy, in every mode.
    Returns {"failures": {peer: [str]}, "diffs": {(peer, mode, strategy):
    (max loss diff, max param diff)}, "skipped": {peer: reason}}."""
    deepspeed = import_deepspeed() if any(p.startswith("deepspeed") for p in peers) else None
    runs = {"torch_ddp": run_torch_ddp, "torch_fsdp2": run_torch_fsdp2}
    skipped = {}
    for stage in (1, 2, 3):
        if isinstance(deepspeed, str):
            skipped[f"deepspeed_zero{stage}"] = deepspeed
        else:
            runs[f"deepspeed_zero{stage}"] = lambda mode, stage=stage: run_deepspeed(deepspeed, stage, mode)
    result = {"failures": {p: [] for p in peers}, "diffs": {}, "skipped": skipped}
    for mode in modes:
        ours = {s: run_tiny_zero(s, mode) for s in STRATEGIES}
        for peer in peers:
            if peer in skipped:
                continue
            theirs = runs[peer](mode)
            for s in STRATEGIES:
                failures, loss_diff, param_diff = differences(peer, s, mode, theirs, ours[s])
                result["failures"][peer] += failures
                result["diffs"][peer, mode, s] = (loss_diff, param_diff)
    return result


# ---------------------------------------------------------------- the benchmark's memory count
def benchmark_memory(runs):
    """example/benchmark/peers.py's measure() of `runs` on the tiny GPT:
    (its parameter count, {run: result}), to check how its tracker splits
    each peer's peak."""
    from example.benchmark import peers
    from example.data import ByteData, load_text
    from example.model import build_model, count_parameters
    args = SimpleNamespace(model="tiny", batch_size=2, seq_len=32, seed=0, warmup=2, steps=1)
    data = ByteData(load_text(), args.seq_len)
    if any(name.startswith("deepspeed") for name in runs) and isinstance(import_deepspeed(), str):
        runs = [name for name in runs if not name.startswith("deepspeed")]  # test_peers says why
    results = {name: peers.measure(name, args, data, torch.device("cpu")) for name in runs}
    return count_parameters(build_model(args.model, device="meta")), results


def everything(peers, modes, memory_runs):
    """One world for the whole file: peer_parity, then benchmark_memory."""
    return {"parity": peer_parity(peers, modes), "memory": benchmark_memory(memory_runs)}
