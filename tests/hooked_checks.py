"""Worker functions for tests/test_hooked.py: a plain torch model whose
parameters live in modules tiny_zero has no layer for (Conv2d, BatchNorm2d,
MultiheadAttention, a bare nn.Parameter, a norm class on no list, a Linear
subclass with a forward of its own), trained by every strategy through module
hooks (tiny_zero/hooked.py), against torch DDP in the same world.

A check returns what went wrong as a list of strings (empty: all is well)."""
import copy
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tiny_zero
from tiny_zero import comm, explain
from tiny_zero.buckets import DEFAULT_BUCKET_BYTES
from tiny_zero.measure import estimate, trace

PER_RANK, STEPS = 2, 3
LR, WD, EPS = 1e-2, 0.1, 1.0  # eps=1: attention (see tests/parity_checks.py)
RTOL, ATOL = 1e-5, 1e-6
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp", "offload"]


class Scale(nn.Module):
    """A bare nn.Parameter read by its module's own forward (ViT's CLS token, a layer scale)."""

    def __init__(self, width):
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(width))
        self.cls = nn.Parameter(torch.randn(1, 1, width))

    def forward(self, h):
        return torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1) * self.gamma


class OwnNorm(nn.Module):
    """An RMSNorm on no list."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(1 + torch.randn(width) / 4)

    def forward(self, h):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ScaledLinear(nn.Linear):
    """A subclass of Linear with a forward of its own (Falcon's, BART's embeddings)."""

    def forward(self, x):
        return F.linear(x, self.weight * 0.5, self.bias)


class Block(nn.Module):
    """One unit of zero3 and fsdp: hooked modules beside tiny_zero's Linear."""

    def __init__(self, width):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.norm = OwnNorm(width)
        self.mlp = nn.Linear(width, width)

    def forward(self, h):
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return h + self.mlp(self.norm(h)).relu()


class Net(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.proj = ScaledLinear(8, width)
        self.scale = Scale(width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        h = self.bn(self.conv(x)).relu().flatten(2).transpose(1, 2)  # (batch, pixels, channels)
        h = self.scale(self.proj(h))
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


def batch(step, world_size):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(world_size * PER_RANK, 3, 4, 4, generator=g), torch.randint(0, 5, (world_size * PER_RANK,),
                                                                                  generator=g)
    rank = dist.get_rank()
    return x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]


def train(model, opt, world_size, watch=None):
    """Per step: the loss averaged over ranks. Then the module's state_dict."""
    losses = []
    for step in range(STEPS):
        x, y = batch(step, world_size)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if watch is not None:
            watch()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses


def released(p):
    """A parameter holding no values of its own here (zero3, fsdp: tiny_zero/holding.py's released)."""
    return p.numel() > 1 and all(s == 0 for s in p.stride())


def freed_checks(model, failures):
    """fsdp: a hooked module outside the blocks (a unit of its own) has its
    parameters freed as its forward returns (seen by a forward hook
    registered after the wrapper's), and everything is freed after the
    backward; returns the check to run after each backward."""
    module = model.module

    def after_forward(m, args, output):
        if not all(released(p) for p in m.parameters()):
            failures.append(f"fsdp: {type(m).__name__}'s parameters still gathered after its forward")

    for m in (module.conv, module.scale):
        m.register_forward_hook(after_forward)
    return lambda: all(map(released, module.parameters())) or failures.append("fsdp: gathered after backward")


def comm_failures(model, strategy, world):
    """One more step sends what the estimate says, the hooked modules' gathers and the buffers' broadcast among it."""
    comm.stats.reset()
    F.cross_entropy(model(*batch(0, world)[:1]), batch(0, world)[1]).backward()
    model.zero_grad()  # no step: its all-gathers (zero1, zero2, offload) are counted by the estimate only with one
    sent, calls = dict(comm.stats.elements), dict(comm.stats.calls)
    want = estimate.comm_per_step(Net(), strategy, world)
    want.pop("all_gather", None) if strategy in ("zero1", "zero2", "offload") else None
    failures = [] if sent == want else [f"{strategy} world {world}: sent {sent}, the estimate says {want}"]
    if strategy == "fsdp":  # and how many of each, as python -m tiny_zero.explain prints them
        counts = explain.collective_counts(Net(), strategy, world, None, DEFAULT_BUCKET_BYTES)
        failures += [] if calls == counts else [f"fsdp world {world}: sent {calls} collectives, explain says {counts}"]
    return failures


def trace_failures(model, opt, world):
    """The timeline of a step shows the hooked modules' forwards as layers (BatchNorm's empty storages drawn as nothing)."""
    recorder = trace.Recorder(model, opt)
    recorder.start()
    F.cross_entropy(model(batch(0, world)[0]), batch(0, world)[1]).backward()
    opt.step()
    opt.zero_grad()
    names = {span["name"] for span in recorder.stop()["spans"] if span["cat"] == "layer"}
    wanted = {"conv forward", "bn forward", "scale forward", "blocks.0.attn forward", "blocks.1.norm forward"}
    return [f"the timeline lacks {sorted(wanted - names)}"] if wanted - names else []


def parity():
    """Every strategy against torch DDP: the loss at every step, every
    parameter and buffer (BatchNorm's running statistics, broadcast from rank
    0 at each forward) after the steps."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    module = Net()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    want_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=WD), world)
    want = ref.module.state_dict()
    failures = []
    for strategy in STRATEGIES:
        try:
            wrapper, optimizer = tiny_zero.STRATEGIES[strategy]
            model = wrapper(copy.deepcopy(module))
            watch = freed_checks(model, failures) if strategy == "fsdp" and world > 1 else None
            losses = train(model, optimizer(model, lr=LR, eps=EPS, weight_decay=WD), world, watch)
            failures += [f"{strategy} world {world} step {i}: loss {got} vs DDP {ok}"
                         for i, (got, ok) in enumerate(zip(losses, want_losses)) if abs(got - ok) > RTOL * abs(ok)]
            state = {**model.full_state_dict(), **dict(model.module.named_buffers())}
            failures += [f"{strategy} world {world}: {key} differs by {(state[key].float() - v.float()).abs().max():.2e}"
                         for key, v in want.items()
                         if not torch.allclose(state[key].float(), v.float(), rtol=RTOL, atol=ATOL)]
            failures += comm_failures(model, strategy, world)
            if strategy == "fsdp":
                failures += trace_failures(model, optimizer(model, lr=LR), world)
        except Exception:  # as a failure: the other strategies still run
            failures.append(f"{strategy}: {traceback.format_exc(limit=-4)}")
    return failures


def accumulation_loop(model, opt):
    """Per step: a backward inside no_sync(), an evaluation under no_grad, one outside, the step."""
    world = dist.get_world_size()
    for step in range(2):
        with model.no_sync():
            F.cross_entropy(model(batch(10 + step, world)[0]), batch(10 + step, world)[1]).backward()
        with torch.no_grad():
            model(batch(50, world)[0])
        F.cross_entropy(model(batch(step, world)[0]), batch(step, world)[1]).backward()
        opt.step()
        opt.zero_grad()


def accumulation():
    """Gradient accumulation (no_sync) with an evaluation between: every
    parameter and buffer as torch DDP's, which broadcasts the buffers at a
    forward that follows one that trained outside no_sync (not at every one)."""
    torch.manual_seed(0)
    module = Net()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    accumulation_loop(ref, torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=WD))
    failures = []
    for strategy in STRATEGIES:
        wrapper, optimizer = tiny_zero.STRATEGIES[strategy]
        model = wrapper(copy.deepcopy(module))
        accumulation_loop(model, optimizer(model, lr=LR, eps=EPS, weight_decay=WD))
        state = {**model.full_state_dict(), **dict(model.module.named_buffers())}
        failures += [f"{strategy} no_sync: {key} differs" for key, v in ref.module.state_dict().items()
                     if not torch.allclose(state[key].float(), v.float(), rtol=RTOL, atol=ATOL)]
    return failures


from hooked_parallel_checks import pipeline, tensor  # noqa: E402,F401  (run in the same world)
from outside_read_checks import gathered_where_read, read_released  # noqa: E402,F401


def sync_batchnorm():
    """A model converted by torch.nn.SyncBatchNorm.convert_sync_batchnorm wraps
    under every strategy (a hooked module: nothing refused for its class). On
    the CPU torch refuses it: torch DDP at wrap time, SyncBatchNorm itself at a
    training forward. Here every strategy raises SyncBatchNorm's own error on
    every rank at the training forward, and the world goes on; in eval mode
    every output equals the module's own."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    module = nn.SyncBatchNorm.convert_sync_batchnorm(Net())
    x = batch(0, world)[0]
    failures = []
    try:
        nn.parallel.DistributedDataParallel(copy.deepcopy(module))
        failures.append("torch DDP took SyncBatchNorm on the CPU: test it as on a GPU")
    except ValueError:
        pass
    try:
        copy.deepcopy(module)(x)
        want_error = None
    except ValueError as e:
        want_error = str(e)
    with torch.no_grad():
        want = copy.deepcopy(module).eval()(x)
    for strategy in STRATEGIES:
        model = tiny_zero.STRATEGIES[strategy][0](copy.deepcopy(module))
        try:
            model(x)
            got_error = None
        except ValueError as e:
            got_error = str(e)
        if got_error != want_error or want_error is None:
            failures.append(f"{strategy}: a training forward raised {got_error!r}, SyncBatchNorm {want_error!r}")
        model.eval()
        with torch.no_grad():
            got = model(x)
        if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
            failures.append(f"{strategy}: eval output differs by {(got - want).abs().max():.2e}")
    probe = torch.ones(1)
    dist.all_reduce(probe)
    return failures if probe.item() == world else failures + ["the ranks disagree after the raise"]
