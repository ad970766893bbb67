"""Worker for the activation-checkpointing test (run on every rank)."""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import tiny_zero
from tiny_zero import comm
from tiny_zero.measure.memory import TensorMemory
from example.model import build_model
from parity_checks import ATOL, RTOL

STEPS = 3


def batch(step):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (4 * world, 65), generator=g)[4 * rank:4 * rank + 4]
    return tokens[:, :-1], tokens[:, 1:]


def reentrant(module):
    """Each block under torch's reentrant checkpoint (use_reentrant=True, transformers 4's default):
    its forward runs under no_grad, and backward runs it again."""
    for block in module.blocks:
        block.forward = lambda x, forward=block.forward: checkpoint(forward, x, use_reentrant=True)
    return module


def run(name, checkpoint_activations):
    wrapper_cls, opt_cls = tiny_zero.STRATEGIES[name]
    module = build_model("tiny", n_layer=4, checkpoint_activations=checkpoint_activations is True)
    if checkpoint_activations == "reentrant":
        module = reentrant(module)
    options = {} if name == "fsdp" else {"bucket_bytes": 16 * 1024}
    model = wrapper_cls(module, **options)
    opt = opt_cls(model, lr=1e-3)
    losses, peaks, sent_in_backward, gathers = [], [], [], []
    late = []  # how many buckets each backward left to its end (0: all sent during backward)
    unsent = model.buckets.unsent

    def counted_unsent():
        rest = unsent()
        late.append(len(rest))
        return rest
    model.buckets.unsent = counted_unsent
    for step in range(STEPS):
        comm.stats.reset()
        with TensorMemory() as memory:  # counts what the step allocates: activations, grads, gathers
            loss = model(*batch(step))
            model.backward(loss)
        peaks.append(memory.peak)
        gathers.append(comm.stats.calls["broadcast"] + comm.stats.calls["all_gather"])  # zero3's, fsdp's
        sent_in_backward.append(late[-1] == 0)  # none held back
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.full_state_dict(), max(peaks), all(sent_in_backward), gathers[-1]


def compare(names):
    out = {}
    for name in names:
        plain = run(name, False)
        for mode in (True, "reentrant"):
            ckpt = run(name, mode)
            out[name, mode] = dict(
                loss_diff=max(abs(a - b) for a, b in zip(plain[0], ckpt[0])),
                param_diff=max((plain[1][k] - ckpt[1][k]).abs().max().item() for k in plain[1]),
                peak_plain=plain[2], peak_ckpt=ckpt[2], overlap_plain=plain[3], overlap_ckpt=ckpt[3],
                gathers_plain=plain[4], gathers_ckpt=ckpt[4])
    return out


class FrozenBlock(nn.Module):
    """A block whose only trainable layer is its first Linear (LoRA-like: the
    rest frozen), so that under a reentrant checkpoint the frozen layers'
    forward sees inputs that do not require grad, and backward runs through
    them all the same."""

    def __init__(self, width):
        super().__init__()
        self.first, self.second, self.third = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + self.third(torch.tanh(self.second(self.norm(torch.tanh(self.first(x))))))


class FrozenNet(nn.Module):
    def __init__(self, width=6, depth=3):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(FrozenBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.checkpoint = None  # None, or use_reentrant for torch's checkpoint of each block
        for name, p in self.named_parameters():
            p.requires_grad = ".first." in name
        # transformers' enable_input_require_grads(): the frozen input layer's output
        # requires grad, so that a checkpointed block's input does
        self.embed.register_forward_hook(lambda module, args, out: out.requires_grad_(True))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) if self.checkpoint is None else checkpoint(block, h, use_reentrant=self.checkpoint)
        return self.head(h).square().mean()


def frozen_batch(step, world):
    return torch.randn(3 * world, 4, generator=torch.Generator().manual_seed(step))


def frozen_blocks_train_as_torch(names, steps=4):
    """FrozenNet, every block checkpointed (reentrant, and not), trained by each
    strategy and by torch.optim.AdamW on one process and the whole batch: the
    same losses and parameters. Also the gathers of zero3's and fsdp's last
    step, with and without checkpointing."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = FrozenNet()
    start = copy.deepcopy(reference.state_dict())
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    ref_losses = []
    for step in range(steps):
        loss = reference(frozen_batch(step, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    failures, gathers = [], {}
    for name in names:
        for mode in (None, True, False):
            wrapper_cls, opt_cls = tiny_zero.STRATEGIES[name]
            module = FrozenNet()
            module.load_state_dict(start)
            module.checkpoint = mode
            model = wrapper_cls(module)
            opt = opt_cls(model, lr=1e-2, weight_decay=0.1)
            for step in range(steps):
                comm.stats.reset()
                loss = model(frozen_batch(step, world)[3 * rank:3 * rank + 3])
                loss.backward()
                opt.step()
                opt.zero_grad()
                total = loss.detach().clone()
                dist.all_reduce(total)
                if abs(total.item() / world - ref_losses[step]) > ATOL + RTOL * abs(ref_losses[step]):
                    failures.append(f"{name}/{mode} step {step}: loss {total.item() / world} vs torch {ref_losses[step]}")
            gathers[name, mode] = comm.stats.calls["broadcast"] + comm.stats.calls["all_gather"]
            for key, value in model.full_state_dict().items():
                if not torch.allclose(value, reference.state_dict()[key], rtol=RTOL, atol=ATOL):
                    failures.append(f"{name}/{mode}: {key} differs from torch's")
    return failures, gathers
