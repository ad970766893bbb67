"""torch's Join on uneven inputs (docs/training-loop.md): rank r has 4 - r
batches; under every data-parallel strategy, with either
divide_by_initial_world_size (True with a clip in the loop), the parameters after the Join are torch
DDP's under Join in the same world, and a step after it keeps every rank equal."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from harness import run_world  # noqa: E402

ALL = ["ddp", "zero1", "zero2", "zero3", "fsdp", "offload"]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_join_equals_torch_ddps_join(world_size):
    failures = [f for rank in run_world(world_size, "join_checks", "join_equals_torch_ddp", ALL, timeout=300)
                for f in rank]
    assert not failures, "\n".join(failures[:30])
