"""Modules tiny_zero has no layer for train through module hooks
(tiny_zero/hooked.py) under every data-parallel strategy, equal to torch DDP:
Conv2d, BatchNorm2d (its statistics broadcast from rank 0, as DDP's),
MultiheadAttention (which reads its out_proj's weight itself), a bare
nn.Parameter, a norm class on no list and a Linear subclass with a forward of
its own (tests/hooked_checks.py)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import run_checks


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_hooked_modules_train_as_torch_ddp(world_size):
    """Every strategy: the loss at every step, every parameter and buffer after
    3 AdamW steps; at world 2 also gradient accumulation under no_sync() with an
    evaluation between; what is sent, as the estimate and explain say; fsdp
    frees what it gathered; the timeline draws the hooked modules."""
    plan = [("parity", "parity", ())] + ([("accumulation", "accumulation", ())] if world_size == 2 else [])
    failures = [f for per_rank in run_checks(world_size, "hooked_checks", plan).values() for rank in per_rank
                for f in rank]
    assert not failures, "\n".join(failures[:40])


def test_parameters_read_outside_their_module_world_2():
    """A frozen parameter outside every block read in another module's
    functional call, and the wrapped module's own read in its forward, train
    equal to torch DDP under every strategy; under zero3 and fsdp a trainable
    weight tied by hand (F.linear(h, emb.weight)) and a block's frozen weight
    read after its block raise on every rank at the read, naming it
    (tests/outside_read_checks.py)."""
    results = run_checks(2, "outside_read_checks", [("gathered", "gathered_where_read", ()),
                                                     ("released", "read_released", ())])
    failures = [f for per_rank in results.values() for rank in per_rank for f in rank]
    assert not failures, "\n".join(failures[:40])
