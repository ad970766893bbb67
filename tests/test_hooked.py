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

from harness import run_world


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_hooked_modules_train_as_torch_ddp(world_size):
    failures = [f for rank in run_world(world_size, "hooked_checks", "parity") for f in rank]
    assert not failures, "\n".join(failures[:40])
