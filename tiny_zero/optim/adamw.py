"""AdamW: a flat-tensor update function and a drop-in torch.optim.AdamW built on it.

`adamw_update_` steps one flat fp32 tensor in place and dispatches to the fused Triton kernel
(kernel.py, GPU), to plain torch ops (reference.py), or, asked for by name, to torch's own
fused AdamW kernel (fused.py: the fastest on the CPU, where ZeRO-Offload steps). The ZeRO/FSDP strategies call it directly
on their flat shards; `AdamW` calls it once per parameter, or, for fp32 parameters on the CPU,
steps them all at once with the same math in torch's multi-tensor ops (reference.py).

Triton is imported lazily, only when the Triton path actually runs, so this module works on
machines where triton is missing or cannot compile.
"""

import functools
import os

import torch

from ..precision import take_written_
from .fused import fused_adamw_update_
from .reference import torch_adamw_update_, torch_adamw_update_many_

KERNELS = ("auto", "triton", "torch", "fused")


@functools.lru_cache(maxsize=None)
def _triton_importable():
    try:
        import triton  # noqa: F401
        return True
    except Exception:
        return False


def _triton_interpret():
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


def _check_kernel(kernel):
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")


def adamw_update_(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                  grad_scale=1.0, param_out=None, kernel="auto", found_inf=None):
    """One AdamW step on flat 1-D tensors of equal numel, in place.

    param: fp32 (master weights), contiguous. grad: any float dtype; the step uses
    grad.float() * grad_scale (grad_scale: 1/loss_scale times a clipping coefficient; a number, or
    a 0-d fp32 tensor on param's device that the kernel reads itself, so the host never waits for it).
    exp_avg, exp_avg_sq: fp32, updated in place. step: the step count after incrementing (>= 1),
    a number, or a 0-d tensor on param's device that the kernel reads (fp16's counts, which a
    skipped step does not advance: only the device knows them).
    param_out: optional tensor of the same numel (fp16/bf16/fp32) that receives the updated
    param, cast, in the same pass.
    found_inf: None, or a 0-d fp32 tensor on param's device (fp16's overflow, as torch's fused
    AdamW takes it): where it is nonzero the update writes nothing (param, moments, param_out).
    kernel: "auto" (triton when param is on CUDA and triton imports, else torch) | "triton" | "torch"
    | "fused" (torch's fused AdamW kernel, fused.py).
    """
    _check_kernel(kernel)
    tensors = [param, grad, exp_avg, exp_avg_sq] + ([] if param_out is None else [param_out])
    if any(t.dim() != 1 or not t.is_contiguous() or t.numel() != param.numel() for t in tensors):
        raise ValueError("adamw_update_ expects contiguous 1-D tensors of equal numel")
    if any(t.device != param.device for t in tensors):
        raise ValueError("adamw_update_ expects all tensors on the same device")
    if not (param.dtype == exp_avg.dtype == exp_avg_sq.dtype == torch.float32):
        raise ValueError("param, exp_avg and exp_avg_sq must be fp32")
    if not isinstance(step, torch.Tensor) and step < 1:
        raise ValueError(f"step must be >= 1 (the count after incrementing), got {step}")

    if kernel == "auto":
        kernel = "triton" if param.is_cuda and _triton_importable() else "torch"
    if kernel == "torch":
        update = torch_adamw_update_
    elif kernel == "fused":
        update = fused_adamw_update_
    else:
        if not param.is_cuda and not _triton_interpret():
            raise RuntimeError("the triton AdamW kernel needs CUDA tensors, or TRITON_INTERPRET=1 "
                               "(set before triton is imported) to run on CPU in Triton's interpreter")
        from .kernel import triton_adamw_update_ as update
    update(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
           weight_decay=weight_decay, step=step, grad_scale=grad_scale, param_out=param_out, found_inf=found_inf)


def check_hparams(lr, betas, eps, weight_decay):
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas}")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_group(group):
    """A param group (defaults filled in), as it is added: its hyperparameters
    as torch.optim.AdamW checks them, and check_options."""
    check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    check_options(group)


def check_options(group):
    """None of torch.optim.AdamW's options that tiny_zero's AdamW lacks, which
    it would otherwise ignore without a word. Also checked at every step: a
    group may change after it is added (load_state_dict of a torch checkpoint)."""
    for option in ("amsgrad", "maximize"):
        if group.get(option):
            raise ValueError(f"tiny_zero's AdamW has no {option}: a param group sets {option}=True")


class AdamW(torch.optim.Optimizer):
    """Drop-in for torch.optim.AdamW (amsgrad=False, maximize=False), same defaults and state layout.

    fp16/bf16 params get an fp32 master copy in state["master"]; the master is stepped and the
    param is written back in the same pass. exp_avg and exp_avg_sq are always fp32.
    `self.grad_scale` (float, default 1.0) multiplies every grad inside the update; whoever sets
    it (loss scaling, clipping) is responsible for resetting it.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, kernel="auto"):
        check_hparams(lr, betas, eps, weight_decay)
        _check_kernel(kernel)
        self.kernel = kernel
        self.grad_scale = 1.0
        self.versions = {}  # low-precision parameter -> its version counter after the step wrote it
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def add_param_group(self, param_group):
        check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            check_options(group)
            beta1, beta2 = group["betas"]
            together = []  # (param, grad, state) stepped at once with multi-tensor ops
            for p in group["params"]:
                grad = self.grad_of(p)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                if not p.is_floating_point():
                    raise RuntimeError(f"AdamW supports real floating-point params, got {p.dtype}")
                state = self.init_state(p)
                state["step"] += 1

                if self.kernel in ("auto", "torch") and not p.is_cuda and p.dtype == torch.float32:
                    together.append((p, grad, state))  # the CPU's plain torch path: one call per formula line
                    continue
                if p.dtype == torch.float32:
                    work = p if p.is_contiguous() else p.contiguous()  # a copy only for unusual layouts
                    out = None
                else:
                    work = state["master"]
                    self.take_write(p, work)
                    out = p.view(-1) if p.is_contiguous() else None
                adamw_update_(work.view(-1), grad.reshape(-1), state["exp_avg"].view(-1),
                              state["exp_avg_sq"].view(-1), lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                              eps=group["eps"], weight_decay=group["weight_decay"], step=state["step"].item(),
                              grad_scale=self.grad_scale, param_out=out, kernel=self.kernel)
                if work is not p and out is None:
                    p.copy_(work)
                if p.dtype != torch.float32:
                    self.versions[p] = p._version  # the step's own write is not the user's
            if together:
                params, grads, states = zip(*together)
                torch_adamw_update_many_(list(params), list(grads), [s["exp_avg"] for s in states],
                                         [s["exp_avg_sq"] for s in states], lr=float(group["lr"]), beta1=beta1,
                                         beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                                         steps=[s["step"].item() for s in states], grad_scale=self.grad_scale)
        return loss

    def take_write(self, p, master):
        """A write into a low-precision p in place since the step last wrote it
        (p.mul_(mask), p.clamp_(), nn.init: its version counter moved) lasts,
        as in torch: the elements it changed go into the fp32 master, which the
        step would otherwise write back over them."""
        if self.versions.get(p) != p._version:
            take_written_(master, p.detach())

    def grad_of(self, param):
        """The grad to step `param` with (strategies keep theirs elsewhere)."""
        return param.grad

    @torch.no_grad()
    def init_state(self, p):
        """p's state, created as the first step creates it (step 0, zero moments, an fp32 master
        for a low-precision p) if it does not exist yet. A checkpoint load uses it to fill the
        state of an optimizer that has not stepped."""
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)  # a CPU float32 scalar, as torch keeps it
            fp32_zeros = dict(dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg"] = torch.zeros_like(p, **fp32_zeros)
            state["exp_avg_sq"] = torch.zeros_like(p, **fp32_zeros)
            if p.dtype != torch.float32:
                state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        return state

    def load_state_dict(self, state_dict):
        # torch casts floating-point state to each param's dtype; our moments and master stay fp32.
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(i, {}).items():
                if key != "step":
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32,
                                                  memory_format=torch.contiguous_format)
