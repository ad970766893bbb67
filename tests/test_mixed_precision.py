"""Mixed precision: bf16/fp16 track fp32, fp16 overflows skip the step on
every rank, and the loss scale follows DeepSpeed's rule exactly."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import run_checks  # noqa: E402

from tiny_zero.precision import LossScaler  # noqa: E402

ALL = ["ddp", "zero1", "zero2", "zero3", "fsdp", "offload"]


@pytest.fixture(scope="module")
def world2():
    plan = [("tracks", "tracks_fp32", (ALL,))]
    plan += [(("poisoned", n), "poisoned_step_skips_everywhere", (n,)) for n in ALL]
    plan += [("same_rows", "fp16_same_rows_takes_every_step", (ALL + ["tensor"],))]
    return run_checks(2, "precision_checks", plan)


@pytest.mark.slow
def test_low_precision_tracks_fp32(world2):
    failures = world2["tracks"]
    assert not [f for rank in failures for f in rank], failures


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_overflow_on_one_rank_skips_on_all(name, world2):
    for rank, r in enumerate(world2["poisoned", name]):
        assert r["changed"] == [], (rank, r)
        assert r["skipped"] == 2, (rank, r)
        assert r["scales"] == [2.0**8, 2.0**8, 2.0**7], (rank, r)  # hysteresis 2: the 2nd overflow halves
        assert r["moved_after"] > 0, (rank, r)


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL + ["tensor"])
def test_fp16_ranks_take_the_steps_one_process_takes(name, world2):
    """The same rows on both ranks, the largest scaled grad near 45,000:
    averaged as torch DDP averages (divided, then summed), no step is
    skipped where one process skips none, and the parameters are one
    process's (fp32 reduction of the same grads)."""
    for rank, runs in enumerate(world2["same_rows"]):
        skipped, control_skipped, scales, control_scales, differ = runs[name]
        assert control_skipped == 0, (rank, control_scales)  # the setting: one process takes every step
        assert skipped == 0 and scales == control_scales, (rank, name, skipped, scales)
        assert differ == [], (rank, name, differ)


def test_loss_scale_sequence():
    """A scripted pattern of overflows (o) and clean steps (.), window 3,
    hysteresis 2, min scale 4: the exact scales after each step."""
    scaler = LossScaler(init_scale=64, window=3, hysteresis=2, min_scale=4)
    pattern = "..o.o..o.o.o....oo.."
    scales = []
    for step in pattern:
        scaler.update(step == "o")
        scales.append(scaler.scale)
    # The first overflow only uses up the hysteresis; later ones halve the
    # scale, down to 4. Four clean steps in a row (window + 1, DeepSpeed's
    # count) would double it and restore the hysteresis: none here.
    #            .   .   o   .   o   .   .   o   .   o  .  o  .  .  .  .  o  o  .  .
    expected = [64, 64, 64, 64, 32, 32, 32, 16, 16, 8, 8, 4, 4, 4, 4, 8, 8, 4, 4, 4]
    assert scales == expected


def test_loss_scale_follows_deepspeed(monkeypatch):
    """Random overflow patterns, windows 1 to 4, hysteresis 1 to 3: after every
    update the scale equals DeepSpeed's DynamicLossScaler's."""
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)  # its log lines ask; no world is needed
    g = torch.Generator().manual_seed(0)
    for window in (1, 2, 3, 4):
        for hysteresis in (1, 2, 3):
            ours = LossScaler(init_scale=2.0**30, window=window, hysteresis=hysteresis, min_scale=1)
            theirs = loss_scaler.DynamicLossScaler(init_scale=2.0**30, scale_window=window, min_scale=1,
                                                   delayed_shift=hysteresis, consecutive_hysteresis=False,
                                                   raise_error_at_min_scale=False)
            for step, overflow in enumerate((torch.rand(60, generator=g) < 0.3).tolist()):
                ours.update(overflow)
                theirs.update_scale(overflow)
                assert ours.scale == theirs.cur_scale, (window, hysteresis, step)


def test_overflow_at_min_scale_raises():
    scaler = LossScaler(init_scale=2, window=1000, hysteresis=1, min_scale=1)
    scaler.update(True)
    assert scaler.scale == 1
    with pytest.raises(RuntimeError, match="minimum loss scale"):  # torch._assert_async: the device decides
        scaler.update(True)
