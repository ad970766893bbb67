"""Worker for the activation-checkpointing test (run on every rank)."""
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import tiny_zero
from tiny_zero.measure.memory import TensorMemory
from example.model import build_model

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
    losses, peaks, sent_in_backward = [], [], []
    late = []  # how many buckets each backward left to its end (0: all sent during backward)
    unsent = model.buckets.unsent

    def counted_unsent():
        rest = unsent()
        late.append(len(rest))
        return rest
    model.buckets.unsent = counted_unsent
    for step in range(STEPS):
        with TensorMemory() as memory:  # counts what the step allocates: activations, grads, gathers
            loss = model(*batch(step))
            model.backward(loss)
        peaks.append(memory.peak)
        sent_in_backward.append(late[-1] == 0)  # none held back
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.full_state_dict(), max(peaks), all(sent_in_backward)


def compare(names):
    out = {}
    for name in names:
        plain = run(name, False)
        for mode in (True, "reentrant"):
            ckpt = run(name, mode)
            out[name, mode] = dict(
                loss_diff=max(abs(a - b) for a, b in zip(plain[0], ckpt[0])),
                param_diff=max((plain[1][k] - ckpt[1][k]).abs().max().item() for k in plain[1]),
                peak_plain=plain[2], peak_ckpt=ckpt[2], overlap_plain=plain[3], overlap_ckpt=ckpt[3])
    return out
