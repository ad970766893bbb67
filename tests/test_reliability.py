"""Bad input and hangs: clear errors on every rank, within seconds."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from harness import run_world  # noqa: E402


@pytest.mark.slow
def test_misuse_raises_on_every_rank():
    for errors in run_world(2, "reliability_checks", "misuse", timeout=60):
        assert "already wrapped by Zero2" in errors["wrap twice"]
        assert "FSDPAdamW steps a FSDP-wrapped model, got Zero2" in errors["wrong optimizer"]
        assert "got ParityNet" in errors["plain module"]
        assert "emb.weight is torch.float64: " in errors["float64 module"]
        assert "the module is torch's DistributedDataParallel: wrap its .module" in errors["inside torch DDP"]
        assert errors["step before backward moved"] == []


@pytest.mark.parametrize("name,collective,where", [
    ("zero3", "the agreement on the layer to gather in forward", "emb forward"),  # before the first gather
    ("ddp", "the agreement on this backward pass", "head backward"),  # before the first bucket is sent
])
@pytest.mark.slow
def test_a_skipped_forward_times_out_naming_the_collective(name, collective, where):
    message, seconds = run_world(2, "reliability_checks", "skipped_forward", name, timeout=60)[0]
    assert message.startswith(collective), message
    assert f" {where}" in message and "a rank may have skipped" in message, message
    assert seconds < 20, seconds  # the timeout is 3 s: seconds, not a hang
