"""Worker functions for tests/test_hooked.py: parameters read outside the
module that holds them. A frozen one outside every block, read in another
module's functional call (DeBERTa's relative embeddings), and a trainable one
of the wrapped module (CLIP's logit_scale), read in its forward and in the
blocks', are gathered where they are read: every strategy trains equal to
torch DDP. A trainable weight
tied by hand (h @ emb.weight.T at the root) and a block's frozen
weight read after its block are read released under zero3 and fsdp: every
rank raises before the read computes (units.ReleasedReads), naming it.

A check returns what went wrong as a list of strings (empty: all is well)."""
import copy
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tiny_zero

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp", "offload"]
VOCAB, WIDTH, STEPS = 11, 8, 3
LR, WD, EPS = 1e-2, 0.1, 1.0
RTOL, ATOL = 1e-5, 1e-6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, h, table, gain):
        return h + self.fc(self.norm(h)).tanh() * gain + F.linear(h, table).mean(-1, keepdim=True)  # others' weights


class ReadNet(nn.Module):
    """`read`: None (the reads that are gathered), "tied" (a trainable weight
    tied by hand), "block" (a block's frozen weight read after the blocks)."""

    def __init__(self, read=None):
        super().__init__()
        self.read = read
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.table = nn.Embedding(3, WIDTH)  # frozen, outside every block, read by the blocks only
        self.table.weight.requires_grad_(False)
        self.table.weight.data.mul_(10)  # read as zeros, the loss would move far
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.gain = nn.Parameter(torch.ones(WIDTH) + torch.randn(WIDTH) / 4)  # the root's own
        self.head = nn.Linear(WIDTH, VOCAB)
        if read == "block":
            self.blocks[0].norm.weight.requires_grad_(False)

    def forward(self, idx):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h, self.table.weight, self.gain)
        h = h * self.gain
        if self.read == "tied":
            return h @ self.emb.weight.T
        if self.read == "block":
            h = h * self.blocks[0].norm.weight
        return self.head(h)


def batch(step):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, VOCAB, (2 * dist.get_world_size(), 5), generator=g)
    rank = dist.get_rank()
    return idx[2 * rank:2 * rank + 2], torch.roll(idx, 1, 1)[2 * rank:2 * rank + 2]


def train(model, opt):
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def gathered_where_read():
    """Every strategy equal to torch DDP: the loss at every step, every parameter after the steps."""
    torch.manual_seed(0)
    module = ReadNet()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    want_losses = train(ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, eps=EPS,
                                               weight_decay=WD))
    want = ref.module.state_dict()
    failures = []
    for strategy in STRATEGIES:
        try:
            wrapper, optimizer = tiny_zero.STRATEGIES[strategy]
            model = wrapper(copy.deepcopy(module))
            losses = train(model, optimizer(model, lr=LR, eps=EPS, weight_decay=WD))
            failures += [f"{strategy} step {i}: loss {got} vs DDP {ok}" for i, (got, ok)
                         in enumerate(zip(losses, want_losses)) if abs(got - ok) > RTOL * abs(ok)]
            state = model.full_state_dict()
            failures += [f"{strategy}: {key} differs by {(state[key] - v).abs().max():.2e}" for key, v in want.items()
                         if not torch.allclose(state[key], v, rtol=RTOL, atol=ATOL)]
        except Exception:
            failures.append(f"{strategy}: {traceback.format_exc(limit=-4)}")
    return failures


def read_released():
    """zero3 and fsdp: the first forward raises on every rank at the read, naming the parameter; the world goes on."""
    failures = []
    for read, name in [("tied", "emb.weight"), ("block", "blocks.0.norm.weight")]:
        for strategy in ["zero3", "fsdp"]:
            torch.manual_seed(0)
            model = tiny_zero.STRATEGIES[strategy][0](ReadNet(read))
            try:
                model(batch(0)[0])
                failures.append(f"{strategy} {read}: read released, no error")
            except RuntimeError as e:
                if f"{name} was read while released" not in str(e):
                    failures.append(f"{strategy} {read}: unclear error {str(e)[:300]}")
    probe = torch.ones(1)
    dist.all_reduce(probe)  # every rank is here: none waits in a collective of the raised pass
    return failures if probe.item() == dist.get_world_size() else failures + ["the ranks disagree after the raise"]
