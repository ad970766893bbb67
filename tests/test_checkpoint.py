"""Sharded checkpoints (tiny_zero.checkpoint): resuming (with two param
groups and an lr scheduler, restored as torch users do) is bit-identical on
the same strategy and world size (fp32, bf16, and fp16 with its loss
scaler), and within 5e-5 across strategies and world sizes (zero2 at 2
ranks -> fsdp at 3 -> ddp at 1 among them); the optimizer's param-group
settings come back, from a checkpoint and from opt.state_dict(); the
consolidated file is the full state_dict and the example GPT loads it
strictly; a crash during save leaves the previous checkpoint; broken
checkpoints (optimizer groups that do not match among them) raise clear
errors on every rank.

Three worlds (2, then 3 and 1 loading what 2 saved) and two CLI runs."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from harness import ROOT, run_world  # noqa: E402

ALL = ["ddp", "zero1", "zero2", "zero3", "fsdp", "offload"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """World 2: every check that saves; returns (root, {check: per-rank results})."""
    root = tmp_path_factory.mktemp("checkpoints")
    return root, by_check(run_world(2, "checkpoint_checks", "world_of_two", str(root)))


@pytest.fixture(scope="module")
def resharded(saved):
    """World 3, then world 1, loading what the worlds before them saved."""
    root, _ = saved
    return (by_check(run_world(3, "checkpoint_checks", "world_of_three", str(root))),
            by_check(run_world(1, "checkpoint_checks", "world_of_one", str(root))))


def by_check(per_rank):
    return {check: [r[check] for r in per_rank] for check in per_rank[0]}


def failures(per_rank):
    return [f for rank in per_rank for f in rank]


@pytest.mark.slow
def test_resume_is_bit_identical_on_the_same_strategy_and_world(saved, resharded):
    _, results = saved
    three, _ = resharded
    problems = failures(results["resume"]) + failures(results["mixed"]) + failures(three["resume"])
    assert not problems, "\n".join(problems[:40])


def test_optimizer_state_dict_carries_the_param_group_settings(saved):
    _, results = saved
    problems = failures(results["settings"])
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_resume_across_strategies_and_world_sizes(resharded):
    three, one = resharded
    problems = failures(three["across"]) + failures(one["across"])
    assert not problems, "\n".join(problems[:40])


def test_consolidate_cli_gives_the_full_state_dict_the_example_loads_strictly(saved, tmp_path):
    root, _ = saved
    out = tmp_path / "gpt.pt"
    command = [sys.executable, "-m", "tiny_zero.checkpoint", "consolidate", str(root / "gpt"), str(out)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    summary = r"gpt\.pt: \d+ tensors, [\d,]+ parameters in fp32, step 1 \(Zero3 on 2 ranks\)"
    assert re.search(summary, run.stdout), run.stdout
    state, full = torch.load(out), torch.load(root / "gpt-full.pt")
    assert list(state) == list(full)  # tied names included, in state_dict order
    assert "lm_head.weight" in state
    for key in full:
        assert state[key].dtype == torch.float32 and torch.equal(state[key], full[key]), key

    from example.model import build_model
    model = build_model("tiny", seed=1)  # other values than the saved ones
    assert not torch.equal(model.wte.weight, state["wte.weight"])
    model.load_state_dict(state, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, full[key]), key
    assert model.lm_head.weight is model.wte.weight


def test_long_work_shows_a_progress_bar_on_rank_0_only(saved, capsys, monkeypatch):
    """Saving, loading and consolidating show a bar once they last
    PROGRESS_AFTER_S; on rank 0 alone (checkpoint_checks.progress_bars)."""
    from tiny_zero.checkpoint import consolidate, sharded
    root, results = saved
    assert not failures(results["progress"]), failures(results["progress"])
    state = consolidate(root / "gpt")  # quick: under the delay, no bar
    assert state and capsys.readouterr().err == ""
    monkeypatch.setattr(sharded, "PROGRESS_AFTER_S", 0)
    consolidate(root / "gpt")
    assert "consolidating:" in capsys.readouterr().err

    from tiny_zero.checkpoint import load_pretrained
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    torch.save(module.state_dict(), root / "two-linears.pt")
    load_pretrained(module, root / "two-linears.pt")
    assert "loading pretrained weights:" in capsys.readouterr().err


def test_consolidate_cli_reports_a_bad_checkpoint(tmp_path):
    out = tmp_path / "out.pt"
    command = [sys.executable, "-m", "tiny_zero.checkpoint", "consolidate", str(tmp_path), str(out)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and not out.exists()
    assert f"error: cannot consolidate checkpoint {tmp_path}: not a tiny_zero checkpoint: it has no meta.pt" \
        in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_crash_during_save_leaves_the_previous_checkpoint(saved):
    _, results = saved
    problems = failures(results["crash"])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case,message", [
    ("missing shard", r"shard-00001-of-00002\.pt is missing"),
    ("truncated shard", r"shard-00000-of-00002\.pt is truncated: \d+ bytes, \d+ were written"),
    ("unreadable shard", r"shard-00001-of-00002\.pt is corrupted: it does not begin as torch\.save's zip "
                         r"files do"),
    ("flipped bit", r"rank 1: shard-00001-of-00002\.pt is corrupted: (param|exp_avg|exp_avg_sq) of "
                    r"[\w.]+\[\d+:\d+\] fails its checksum"),
    ("truncated metadata", r"meta\.pt is corrupted or truncated: torch\.load cannot read it \(\w+: \w+"),
    ("not a checkpoint", r"empty: not a tiny_zero checkpoint: it has no meta\.pt$"),
    ("no checkpoint", r"nothing-here: it does not exist$"),
    ("another model", r"it is a checkpoint of another model \(Zero2\): parameters not in this model: "
                      r"ln\.bias, fc1\.weight, fc1\.bias, fc2\.weight; parameters of this model not in the "
                      r"checkpoint: head\.weight; shapes differ: "
                      r"emb\.weight \(13, 10\) in the checkpoint, \(13, 3\) in this model, ln\.weight"),
    ("fewer groups", r"the optimizer's param groups differ from the checkpoint's: 2 groups saved, 1 in this "
                     r"optimizer$"),
    ("other groups", r"param groups differ from the checkpoint's: group 0 holds ln\.weight in this optimizer's "
                     r"only; group 1 holds ln\.weight in the saved one only$"),
    ("different checkpoints", r"the ranks read different checkpoints \(rank 0: \S+zero2-w2; rank 1: \S+later\): "
                              r"load the same on every rank$"),
    ("unloadable extra", r"zero2-w2 failed: rank 0: extra holds something that torch\.load\(weights_only=True\) "
                         r"cannot read back \(a pathlib\.PosixPath\): use plain Python values and tensors$"),
])
def test_broken_checkpoint_raises_a_clear_error_on_every_rank(saved, case, message):
    _, results = saved
    for rank, messages in enumerate(results["errors"]):
        text = messages[case]
        assert not text.startswith("FAILED"), (rank, text)
        assert text.startswith("saving checkpoint " if case == "unloadable extra" else "cannot load checkpoint "), \
            (rank, text)
        assert re.search(message, text), (rank, text)
        assert "Traceback" not in text and "Unpickl" not in text.split("(")[0], (rank, text)
