"""Worker functions for the mixed-precision tests (run on every rank)."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tiny_zero
from tiny_zero.precision import LossScaler
from parity_checks import HIDDEN, PER_RANK, VOCAB, WIDTH, ParityNet, global_batch

STEPS = 6


def my_batch(step):
    rank, world = dist.get_rank(), dist.get_world_size()
    return [t[rank * PER_RANK:(rank + 1) * PER_RANK] for t in global_batch(step, 0, world)]


def train(name, mixed_precision, clip=None, **options):
    """Per-step (global loss, clip norm) and the final full_state_dict."""
    wrapper_cls, opt_cls = tiny_zero.STRATEGIES[name]
    torch.manual_seed(0)
    model = wrapper_cls(ParityNet(), mixed_precision=mixed_precision, **options)
    opt = opt_cls(model, lr=1e-2, weight_decay=0.1)
    history = []
    for step in range(STEPS):
        loss = model(*my_batch(step))
        model.backward(loss)
        norm = model.clip_grad_norm_(clip) if clip else None
        opt.step()
        opt.zero_grad()
        total = loss.detach().float()
        dist.all_reduce(total)
        history.append((total.item() / dist.get_world_size(), norm))
    return history, model.full_state_dict(), opt


def tracks_fp32(names):
    """bf16, fp16 and bf16-with-fp32-reduction losses and clip norms stay
    within 5e-2 of fp32's; full_state_dict gives fp32 masters."""
    failures = []
    for name in names:
        ref, _, _ = train(name, None, clip=0.5)
        # fp16 starts at 2^8: at the default 2^16 its first steps overflow and
        # are skipped (as in DeepSpeed), so it could not follow fp32 step by step
        for mp, options in (("bf16", {}), ("fp16", {"loss_scaler": LossScaler(init_scale=2**8)}),
                            ("bf16", {"reduce_dtype": torch.float32})):
            history, state, opt = train(name, mp, clip=0.5, **options)
            where = f"{name}/{mp}{'/fp32-reduce' if 'reduce_dtype' in options else ''}"
            for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(history, ref)):
                if abs(loss - ref_loss) > 5e-2 * abs(ref_loss):
                    failures.append(f"{where} step {step}: loss {loss} vs fp32 {ref_loss}")
                if abs(norm - ref_norm) > 5e-2 * ref_norm:
                    failures.append(f"{where} step {step}: clip norm {norm} vs fp32 {ref_norm}")
            if any(v.dtype != torch.float32 for v in state.values()):
                failures.append(f"{where}: full_state_dict is not fp32")
            if all(torch.equal(v, v.to(torch.bfloat16).float()) for v in state.values()):
                failures.append(f"{where}: full_state_dict holds low-precision values, not the fp32 masters")
            if opt.skipped_steps:
                failures.append(f"{where}: {opt.skipped_steps} steps skipped in a run that cannot overflow")
    return failures


def poisoned_step_skips_everywhere(name):
    """fp16: an inf loss on rank 1 only. Every rank skips the step (params
    bit-unchanged), counts it, and follows the loss scaler's rule."""
    wrapper_cls, opt_cls = tiny_zero.STRATEGIES[name]
    torch.manual_seed(0)
    model = wrapper_cls(ParityNet(), mixed_precision="fp16", loss_scaler=LossScaler(init_scale=2**8))
    opt = opt_cls(model, lr=1e-2)
    model.backward(model(*my_batch(0)))  # one clean step first, so masters and AdamW state exist
    opt.step()
    opt.zero_grad()
    scales = [opt.loss_scale]
    before = model.full_state_dict()
    opt_before = opt.state_dict()
    for step in (1, 2):
        loss = model(*my_batch(step))
        if dist.get_rank() == 1:
            loss = loss * float("inf")
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scale)
    after = model.full_state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    changed += optimizer_state_changes(opt_before, opt.state_dict())  # exp_avg, exp_avg_sq and step counts too
    model.backward(model(*my_batch(3)))  # and training goes on
    opt.step()
    moved = [k for k in after if not torch.equal(after[k], model.full_state_dict()[k])]
    steps = {value["step"].item() for key, value in opt.state_dict()["state"].items() if "step" in value}
    if steps != {2.0}:  # the two skipped steps did not count
        changed.append(f"step counts {steps} after two steps taken and two skipped")
    return dict(changed=changed, skipped=opt.skipped_steps, scales=scales, moved_after=len(moved))


def optimizer_state_changes(before, after):
    """The entries of opt.state_dict()["state"] that differ."""
    return [f"{key}.{k}" for key, value in before["state"].items() for k, v in value.items()
            if not torch.equal(v, after["state"][key][k])]


class UntiedNet(nn.Module):
    """Each parameter used once, no weight tied: one grad per parameter per
    backward, so that no grads are summed before the reduction (in fp16 or
    in fp32, by the reduction's dtype). The loss is a sum, so that the
    weights' grads are many times the loss's own (1, times the loss scale,
    which must stay finite in fp16 too)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx, targets):
        logits = self.head(torch.tanh(self.fc1(self.emb(idx))))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1), reduction="sum")


def same_rows(step):
    """The same rows on every rank: the average of the ranks' grads is each rank's grad."""
    return [t[:PER_RANK] for t in global_batch(step, 0, 1)]


def scale_for_largest_grad(target):
    """A loss scale that makes the largest grad of step 0 (fp32, one process) `target`."""
    torch.manual_seed(0)
    net = UntiedNet()
    net(*same_rows(0)).backward()
    return target / max(p.grad.abs().max().item() for p in net.parameters())


def wrap_same_rows(name, **options):
    if name == "tensor":  # no Linear split (tp_size 1): the world is replicas, averaging grads as ddp
        from tiny_zero.tensor import TensorParallel, TensorParallelAdamW
        return TensorParallel(UntiedNet(), plan={}, tp_size=1, **options), TensorParallelAdamW
    wrapper_cls, opt_cls = tiny_zero.STRATEGIES[name]
    return wrapper_cls(UntiedNet(), **options), opt_cls


def fp16_same_rows_takes_every_step(names, steps=3):
    """fp16, every rank given the same rows, a loss scale that puts the
    largest scaled grad near 40,000: finite in fp16, as one process has it,
    but the sum of two ranks' is not (65,504 is fp16's largest). Grads divided
    by N before they are summed give the average, and the steps one process
    takes; the control is the same run with fp32 reduction, whose average of
    equal fp16 grads is exactly each of them, as one process has it: the
    parameters must be equal.
    Returns {name: (skipped steps, control's, loss scales, control's,
    parameters that differ from the control's)}."""
    scale = scale_for_largest_grad(40000.0)
    out = {}
    for name in names:
        runs = []
        for reduce_dtype in (None, torch.float32):
            torch.manual_seed(0)
            model, opt_cls = wrap_same_rows(name, mixed_precision="fp16", reduce_dtype=reduce_dtype,
                                            loss_scaler=LossScaler(init_scale=scale))
            opt = opt_cls(model, lr=1e-2, weight_decay=0.1)
            scales = []
            for step in range(steps):
                model.backward(model(*same_rows(step)))
                opt.step()
                opt.zero_grad()
                scales.append(opt.loss_scale)
            runs.append((opt.skipped_steps, scales, model.full_state_dict()))
        (skipped, scales, state), (control_skipped, control_scales, control) = runs
        differ = [k for k in state if not torch.equal(state[k], control[k])]
        out[name] = (skipped, control_skipped, scales, control_scales, differ)
    return out
