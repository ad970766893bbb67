"""A steady-state step reads no value of the model's data on the host (on a
GPU each such read waits for the device to drain its queue): every strategy,
fp32, bf16 and fp16 (a step that overflows and is skipped among them), with
accumulation (no_sync), with and without clipping, under HostReads
(tests/host_reads.py), which follows the model's data through every op.
torch's own loop (clip_grad_norm_, AdamW(fused=True), GradScaler under fp16)
is the control: it reads nothing either, and a loss.item() is caught."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).parent))
from harness import run_world  # noqa: E402
from host_reads import HostReads  # noqa: E402

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp", "offload"]


@pytest.mark.parametrize("precision", [None, "bf16", "fp16"])
def test_torch_loop_reads_nothing_on_the_host(precision):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.LayerNorm(8), nn.Linear(8, 11))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    dtype = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    x, y = torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5))
    for step in range(4):
        with HostReads(list(model.parameters()) + [x, y]) as reads:
            with torch.autocast("cpu", dtype=dtype, enabled=precision is not None):
                loss = nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert reads.reads == [], reads.reads
    with HostReads(list(model.parameters()) + [x]) as reads:
        model(x).sum().item()  # what a loop that prints its loss each step does
    assert [op for op, _ in reads.reads] == ["aten._local_scalar_dense.default"]


@pytest.mark.slow
def test_strategy_steps_read_nothing_on_the_host():
    found = run_world(2, "host_reads", "strategy_steps", STRATEGIES, [None, "bf16", "fp16"])
    assert found == [[], []], "\n".join(found[0] or found[1])
