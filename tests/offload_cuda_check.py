"""ZeRO-Offload on a GPU, world 1, one process per call (its own NCCL world
and its own CUDA peak); run by tests/test_offload.py. Prints one JSON line.

    python tests/offload_cuda_check.py memory gpt2 offload   # zero2 too: the peak to compare
    python tests/offload_cuda_check.py parity                # failures: parity, host state, overlap
                                                             # (ZeroOffload, and FSDPOffload: stage 3)
"""
import json
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import tiny_zero  # noqa: E402
from tiny_zero.distributed import init_distributed  # noqa: E402
from tiny_zero.fsdp.optim import FSDPOffloadAdamW  # noqa: E402
from tiny_zero.fsdp.wrapper import FSDPOffload  # noqa: E402
from example.model import build_model  # noqa: E402

BATCH, SEQ, STEPS = 4, 256, 3


def memory(model_name, strategy):
    """Peak GPU memory over three bf16 steps (after the wrap), and what the
    GPU holds after a step and zero_grad."""
    wrapper_cls, opt_cls = tiny_zero.STRATEGIES[strategy]
    model = wrapper_cls(build_model(model_name, device="meta"), mixed_precision="bf16")
    opt = opt_cls(model, lr=1e-4)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        tokens = torch.randint(0, 50257, (BATCH, SEQ + 1), generator=g).to(model.device)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        model.backward(loss)
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        del loss, tokens
    torch.cuda.synchronize()
    numel = sum(p.numel() for p in build_model(model_name, device="meta").parameters())
    return {"peak": torch.cuda.max_memory_allocated(), "after_step": torch.cuda.memory_allocated(),
            "flat_params": model.flat_params.nbytes, "numel": numel}


OFFLOADS = {  # name: (wrapper, optimizer, wrapper options)
    "offload": (*tiny_zero.STRATEGIES["offload"], {"bucket_bytes": 200}),
    "stage3_offload": (FSDPOffload, FSDPOffloadAdamW, {}),  # DeepSpeed's stage 3 with offload_optimizer
    "stage3_offload_params": (FSDPOffload, FSDPOffloadAdamW, {"offload_params": True}),  # and offload_param
}


def parity():
    """Each offload (ZeroOffload; FSDPOffload, with and without
    offload_params) against torch on the GPU in the parity modes; then the
    host state and the overlap checks of tests/offload_checks.py, on CUDA."""
    import offload_checks
    from parity_checks import MODES
    failures = []
    for name in OFFLOADS:
        for mode in MODES:
            failures += parity_mode(name, mode)
    return failures + offload_checks.state_on_the_host(None) + offload_checks.state_on_the_host("bf16") \
        + offload_checks.grads_leave_during_backward() + offload_checks.fsdp_state_on_the_host(False) \
        + offload_checks.fsdp_state_on_the_host(True)


def parity_mode(name, mode):
    """OFFLOADS[name] against torch on the GPU, in one of parity_checks.MODES."""
    from parity_checks import ATOL, LR, MODES, RTOL, STEPS as PARITY_STEPS, WD, ParityNet, global_batch
    eps, clip, micro = MODES[mode]
    failures = []
    torch.manual_seed(0)
    ref = ParityNet().cuda()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=eps, weight_decay=WD, foreach=False)
    torch.manual_seed(0)
    wrapper, adamw, options = OFFLOADS[name]
    model = wrapper(ParityNet(), **options)
    opt = adamw(model, lr=LR, eps=eps, weight_decay=WD)
    for step in range(PARITY_STEPS):
        losses = []
        for net, optimizer in ((ref, ref_opt), (model, opt)):
            total = 0.0
            for m in range(micro):
                x, y = (t.to(model.device) for t in global_batch(step, m, 1))
                quiet = net is model and m < micro - 1
                with model.no_sync() if quiet else nullcontext():
                    loss = net(x, y) / micro
                    loss.backward()
                total += loss.item()
            if clip:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) if net is ref else model.clip_grad_norm_(clip)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(total)
        where = f"{name}/{mode} cuda step {step}"
        if abs(losses[1] - losses[0]) > ATOL + RTOL * abs(losses[0]):
            failures.append(f"{where}: loss {losses[1]} vs torch {losses[0]}")
        state = model.full_state_dict()
        for key, want in ref.state_dict().items():
            if not torch.allclose(state[key], want.cpu(), rtol=RTOL, atol=ATOL):
                failures.append(f"{where}: {key} differs by {(state[key] - want.cpu()).abs().max():.2e}")
    return failures


def main():
    init_distributed()  # NCCL, a world of one
    result = memory(*sys.argv[2:4]) if sys.argv[1] == "memory" else parity()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
