"""Each strategy equals single-process torch (nn layers + torch.optim.AdamW on
the concatenated batch) at rtol 1e-5 / atol 1e-6, in fp32, on 1, 2 and 3 ranks
(3 makes uneven shards)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import run_world

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
MODES = ["plain", "eps1", "clip", "no_sync"]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_parity_with_torch(world_size):
    per_rank = run_world(world_size, "parity_checks", "parity", STRATEGIES, MODES)
    failures = [f for rank_failures in per_rank for f in rank_failures]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("name", STRATEGIES)
def test_communication_volume(name):
    elements, numel, padded = run_world(2, "parity_checks", "comm_volume", name)[0]
    if name == "ddp":  # all-reduce of every gradient once: Ψ
        assert elements == {"all_reduce": numel}
    else:  # reduce-scatter Ψ + all-gather Ψ (padded to N equal chunks per bucket)
        assert numel <= padded < numel + 2 * 10
        assert elements == {"reduce_scatter": padded, "all_gather": padded}
