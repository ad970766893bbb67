"""Worker functions for the multi-process parity tests (run on every rank).

Each strategy trains a small model with tied weights, a layer used twice,
bias=False and odd sizes, and is compared after every step with plain torch
(nn layers + torch.optim.AdamW) on one process and the concatenated batch.
"""
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tiny_zero
from tiny_zero import comm

VOCAB, WIDTH, HIDDEN, SEQ, PER_RANK = 13, 10, 7, 5, 3
LR, WD, STEPS = 1e-2, 0.1, 6
RTOL, ATOL = 1e-5, 1e-6
MODES = {  # name: (eps, clip max_norm, micro-batches per step)
    "plain": (1e-8, None, 1),
    "eps1": (1.0, None, 1),  # summing instead of averaging grads would show here
    "clip": (1e-8, 0.05, 1),
    "no_sync": (1e-8, None, 2),
}


class ParityNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH, bias=False)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx, targets):
        h = self.emb(idx)
        h = h + self.fc2(torch.tanh(self.fc1(self.ln(h))))
        h = h + self.fc2(torch.tanh(self.fc1(h)))  # fc1 and fc2 used twice
        return F.cross_entropy(self.head(h).view(-1, VOCAB), targets.reshape(-1))


class FewTensorsNet(nn.Module):
    """Three parameter tensors (fewer than 4 ranks), one of 3 elements."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 3)
        self.ln = nn.LayerNorm(3, bias=False)
        self.head = nn.Linear(3, VOCAB, bias=False)

    def forward(self, idx, targets):
        return F.cross_entropy(self.head(self.ln(self.emb(idx))).view(-1, VOCAB), targets.reshape(-1))


MODELS = {"parity": ParityNet, "few_tensors": FewTensorsNet}


def global_batch(step, micro, world_size):
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, VOCAB, (world_size * PER_RANK, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference(mode, world_size, net="parity"):
    """Single-process torch: per step, the loss, the clip norm and the params."""
    eps, clip, micro = MODES[mode]
    torch.manual_seed(0)
    model = MODELS[net]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps, weight_decay=WD)
    history = []
    for step in range(STEPS):
        loss_sum = 0.0
        for m in range(micro):
            loss = model(*global_batch(step, m, world_size)) / micro
            loss.backward()
            loss_sum += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() if clip else None
        opt.step()
        opt.zero_grad()
        history.append((loss_sum, norm, {k: v.clone() for k, v in model.state_dict().items()}))
    return history


def wrap(name, module, bucket_bytes=200):
    wrapper_cls, _ = tiny_zero.STRATEGIES[name]
    if name == "fsdp":  # one unit per layer: no bucket size
        return wrapper_cls(module)
    return wrapper_cls(module, bucket_bytes=bucket_bytes)


def train_and_compare(name, mode, ref, net="parity"):
    eps, clip, micro = MODES[mode]
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = wrap(name, MODELS[net]())
    opt = tiny_zero.STRATEGIES[name][1](model, lr=LR, eps=eps, weight_decay=WD)
    failures = []
    for step in range(STEPS):
        with torch.no_grad():  # an eval forward between steps must not disturb anything
            model(*[t[rank * PER_RANK:(rank + 1) * PER_RANK] for t in global_batch(99, 0, world)])
        loss_sum = torch.zeros(())
        for m in range(micro):
            x, y = (t[rank * PER_RANK:(rank + 1) * PER_RANK] for t in global_batch(step, m, world))
            with model.no_sync() if m < micro - 1 else nullcontext():
                loss = model(x, y) / micro
                model.backward(loss)
            loss_sum += loss.detach()
        norm = model.clip_grad_norm_(clip) if clip else None
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss_sum)
        ref_loss, ref_norm, ref_state = ref[step]
        where = f"{name}/{mode}/{net} world {world} step {step}"
        if abs(loss_sum.item() / world - ref_loss) > ATOL + RTOL * abs(ref_loss):
            failures.append(f"{where}: loss {loss_sum.item() / world} vs torch {ref_loss}")
        if clip and abs(norm - ref_norm) > ATOL + RTOL * ref_norm:
            failures.append(f"{where}: clip norm {norm} vs torch {ref_norm}")
        state = model.full_state_dict()
        for key, ref_value in ref_state.items():
            if not torch.allclose(state[key], ref_value, rtol=RTOL, atol=ATOL):
                err = (state[key] - ref_value).abs().max().item()
                failures.append(f"{where}: {key} differs by {err:.2e}")
    return failures


def parity(names, modes, net="parity"):
    """Every strategy in `names` x every mode, on this world; returns failures."""
    world = dist.get_world_size()
    failures = []
    for mode in modes:
        ref = reference(mode, world, net)
        for name in names:
            failures += train_and_compare(name, mode, ref, net)
    return failures
