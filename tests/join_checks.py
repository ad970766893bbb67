"""Worker functions of tests/test_join.py (run on every rank): torch's Join
on uneven inputs, each strategy against torch DDP's Join in the same world."""
import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel

import tiny_zero
from parity_checks import LR, PER_RANK, WD, ParityNet, global_batch

MAX_NORM = 0.05  # small: every step clips (with divide_by_initial_world_size=True; False does not clip)
EPS = 1.0  # the update is about lr·g: a wrong divisor shows (where no clip scales it away)


def my_batches(rank, world_size):
    """Rank r has 4 - r batches: the ranks run out one after another."""
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return [tuple(t[rows] for t in global_batch(step, 0, world_size)) for step in range(4 - rank)]


def train(model, opt, clip, batches, divide):
    with Join([model], divide_by_initial_world_size=divide):
        for x, y in batches:
            model(x, y).backward()
            if divide:
                clip()
            opt.step()
            opt.zero_grad()


def torch_ddp_join(batches, divide):
    torch.manual_seed(0)
    model = DistributedDataParallel(ParityNet())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    train(model, opt, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM), batches, divide)
    return model.module.state_dict()


def join_equals_torch_ddp(names):
    """For each strategy and each divide_by_initial_world_size: after the
    Join the parameters are torch DDP's, on every rank; then one more step on
    every rank keeps the ranks equal (they agree, and nothing hangs)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = my_batches(rank, world_size)
    failures = []
    for divide in (True, False):
        expected = torch_ddp_join(batches, divide)
        for name in names:
            torch.manual_seed(0)
            wrapper, adamw = tiny_zero.STRATEGIES[name]
            model = wrapper(ParityNet())
            opt = adamw(model, lr=LR, eps=EPS, weight_decay=WD)
            train(model, opt, lambda: model.clip_grad_norm_(MAX_NORM), batches, divide)
            got = model.full_state_dict()
            for key, value in expected.items():
                if not torch.allclose(got[key], value, rtol=1e-5, atol=1e-6):
                    failures.append(f"{name}, divide_by_initial_world_size={divide}: {key} differs from torch DDP's "
                                    f"by {(got[key] - value).abs().max():.2e}")
            model(*batches[0]).backward()
            opt.step()
            after = torch.cat([v.reshape(-1) for v in model.full_state_dict().values()])
            everyone = [torch.empty_like(after) for _ in range(world_size)]
            dist.all_gather(everyone, after)
            if not all(torch.equal(theirs, after) for theirs in everyone):
                failures.append(f"{name}, divide_by_initial_world_size={divide}: the ranks differ after a step "
                                "that follows the Join")
    return failures
