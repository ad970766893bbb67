"""Each strategy equals single-process torch (nn layers + torch.optim.AdamW on
the concatenated batch) at rtol 1e-5 / atol 1e-6, in fp32, on 1, 2 and 3 ranks
(3 makes uneven shards)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import run_checks, run_world

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp", "offload"]
MODES = ["plain", "eps1", "clip", "no_sync"]


@pytest.mark.parametrize("world_size,modes", [
    (1, MODES), (2, MODES), (3, ["plain", "no_sync"]),  # world 3's other modes run in the full grid:
    pytest.param(3, ["eps1", "clip"], marks=pytest.mark.slow)],  # uneven shards show in any mode
    ids=["world1", "world2", "world3", "world3-eps1-clip"])
def test_parity_with_torch(world_size, modes):
    per_rank = run_world(world_size, "parity_checks", "parity", STRATEGIES, modes)
    failures = [f for rank_failures in per_rank for f in rank_failures]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.slow
def test_parity_world_4_and_degenerate_sizes():
    """World 4: the parity model (plain, eps=1, no_sync), and, clipped, a model
    with fewer tensors (3) than ranks and a LayerNorm of 3 elements (fsdp pads
    it), every strategy."""
    results = run_checks(4, "parity_checks", [
        ("parity", "parity", (STRATEGIES, ["plain", "eps1", "no_sync"], "parity")),
        ("few", "parity", (STRATEGIES, ["clip"], "few_tensors"))])
    failures = [f for per_rank in results.values() for rank in per_rank for f in rank]
    assert not failures, "\n".join(failures[:40])
