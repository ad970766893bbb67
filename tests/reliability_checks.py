"""Worker functions for the bad-input and hang tests (run on every rank)."""
import time

import torch
import torch.distributed as dist

import tiny_zero
from tiny_zero import comm
from parity_checks import PER_RANK, ParityNet, global_batch


def misuse():
    """Each misuse raises a clear error on every rank, before any hang."""
    errors = {}
    model = tiny_zero.Zero2(ParityNet())
    for case, attempt in {
        "wrap twice": lambda: tiny_zero.Zero3(model.module),
        "wrong optimizer": lambda: tiny_zero.FSDPAdamW(model, lr=1e-3),
        "plain module": lambda: tiny_zero.DDPAdamW(ParityNet(), lr=1e-3),
        "float64 module": lambda: tiny_zero.DDP(ParityNet().double()),
        "inside torch DDP": lambda: tiny_zero.DDP(torch.nn.parallel.DistributedDataParallel(ParityNet())),
    }.items():
        try:
            attempt()
            errors[case] = None
        except (TypeError, RuntimeError) as e:
            errors[case] = str(e)
    before = model.full_state_dict()
    tiny_zero.Zero2AdamW(model, lr=1e-3).step()  # before any backward: no grads, so nothing moves, as in torch
    after = model.full_state_dict()
    errors["step before backward moved"] = [k for k in before if not torch.equal(before[k], after[k])]
    return errors


def skipped_forward(name):
    """Rank 1 does not run a forward that rank 0 runs: rank 0's first
    collective must fail within the timeout, naming what and where."""
    comm.set_timeout(3)
    model = tiny_zero.STRATEGIES[name][0](ParityNet())
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(8)  # busy elsewhere: never joins the collective
        return None
    x, y = (t[:PER_RANK] for t in global_batch(0, 0, 2))
    start = time.monotonic()
    try:
        model.backward(model(x, y))
        tiny_zero.STRATEGIES[name][1](model).step()
    except comm.CollectiveError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start
