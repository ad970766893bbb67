"""Worker functions for tests/test_hooked.py: hooked modules (a Conv2d, a bare
nn.Parameter, a norm class on no list) in a pipeline stage and, unsplit, in a
tensor-parallel model, equal to single-process torch. In the pipeline, the
first stage's `side` Linear feeds an output no later stage reads: its weight
gets no grad (None), so AdamW neither steps nor decays it, as in torch.

A check returns what went wrong as a list of strings (empty: all is well)."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hooked_checks import OwnNorm
from tiny_zero.pipeline import Pipeline, PipelineAdamW
from tiny_zero.tensor import TensorParallel, TensorParallelAdamW

WIDTH, CLASSES, ROWS, STEPS = 8, 5, 4, 4
LR, WD, EPS = 1e-2, 0.1, 1.0  # eps=1: see tests/parity_checks.py
RTOL, ATOL = 1e-5, 1e-5


class Patches(nn.Module):
    """A Conv2d and a bare parameter (a CLS token); a second output, `side`'s, that no later stage reads."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, WIDTH, 2, stride=2)
        self.cls = nn.Parameter(torch.randn(1, 1, WIDTH))
        self.side = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.conv(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1)
        return h, self.side(h)


class Mix(nn.Module):
    """A norm class on no list, an MLP (split by the tensor plan); reads the hidden states only."""

    def __init__(self):
        super().__init__()
        self.norm = OwnNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, inputs):
        h, _ = inputs
        return h + self.down(self.up(self.norm(h)).relu())


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, CLASSES)

    def forward(self, h):
        return self.fc(h.mean(1))


def model():
    torch.manual_seed(0)
    return nn.Sequential(Patches(), Mix(), Head())


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, 3, 4, 4, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g)


def reference():
    """Single-process torch: the loss at every step, the parameters after."""
    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        assert ref[0].side.weight.grad is None  # the premise: torch gives it no grad
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, ref.state_dict()


def differences(where, losses, state, want_losses, want):
    failures = [f"{where} step {i}: loss {got} vs torch {ok}" for i, (got, ok) in enumerate(zip(losses, want_losses))
                if abs(got - ok) > RTOL * abs(ok)]
    return failures + [f"{where}: {key} differs by {(state[key] - v).abs().max():.2e}" for key, v in want.items()
                       if not torch.allclose(state[key], v, rtol=RTOL, atol=ATOL)]


def pipeline():
    """Two stages (Patches | Mix, Head), 1F1B, 2 micro-batches, against torch."""
    want_losses, want = reference()
    pipe = Pipeline(model(), F.cross_entropy, microbatches=2, stages=dist.get_world_size(), balance=[1, 2])
    opt = PipelineAdamW(pipe, lr=LR, eps=EPS, weight_decay=WD)
    losses, failures = [], []
    for step in range(STEPS):
        losses.append(pipe.train_step(*batch(step)))
        if pipe.first and pipe.module[0].side.weight.grad is not None:
            failures.append(f"step {step}: side.weight has a grad, which no later stage's read made")
        opt.step()
        opt.zero_grad()
    return failures + differences("pipeline", losses, pipe.full_state_dict(), want_losses, want)


def tensor():
    """Mix's MLP split over the tensor group; the Conv2d, CLS token and norm unsplit, through their hooks."""
    want_losses, want = reference()
    tp = TensorParallel(model(), {"1.up": "column", "1.down": "row"})
    opt = TensorParallelAdamW(tp, lr=LR, eps=EPS, weight_decay=WD)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.cross_entropy(tp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return differences("tensor", losses, tp.full_state_dict(), want_losses, want)
