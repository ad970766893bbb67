"""The example scripts: they train, the distributed ones print the same losses as
one device, the README's main command runs, and bad data gives a one-line error.

Each torchrun launch costs ~10 s on 2 cores, so there are few of them.
"""
import contextlib
import io
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tiny_zero  # noqa: E402
from example import train_common  # noqa: E402

# One thread per process: the 2-core machines this runs on are easily oversubscribed.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY = ["--model", "tiny", "--seq-len", "32", "--eval-batches", "2"]


def script(strategy):
    return str(ROOT / "example" / strategy / "train.py")


def run_in_process(strategy, *flags):
    """Run example/<strategy>/train.py in this process; returns its stdout."""
    out = io.StringIO()
    argv, threads = sys.argv, torch.get_num_threads()
    sys.argv = [script(strategy), *flags]
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path(script(strategy), run_name="__main__")
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
    return out.getvalue()


def run(*command, timeout=120):
    return subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def torchrun(strategy, *flags, nproc=2):
    result = run(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                 script(strategy), *flags)
    assert result.returncode == 0, f"{strategy} failed:\n{result.stdout}\n{result.stderr[-3000:]}"
    return result.stdout


def losses(stdout):
    return [float(m.group(2)) for m in re.finditer(r"^step (\d+) loss (\S+)$", stdout, re.MULTILINE)]


def test_single_device_example_learns():
    out = run_in_process("single_device", *TINY, "--steps", "40", "--batch-size", "8")
    curve = losses(out)
    assert len(curve) == 40
    assert curve[0] > 5.0  # about ln(256) = 5.55 at the start
    assert sum(curve[-5:]) / 5 < curve[0] - 1.0, curve
    assert re.search(r"^val loss \d+\.\d+$", out, re.MULTILINE)
    peak = re.search(r"^peak memory (\d+\.\d+) MiB", out, re.MULTILINE)
    assert peak and float(peak.group(1)) > 0


@pytest.fixture(scope="module")
def single_device_losses():
    """The reference: one process with the global batch of 4."""
    return losses(run_in_process("single_device", *TINY, "--steps", "4", "--batch-size", "4"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp", "offload"])  # zero3: the next test
def test_two_ranks_print_the_single_device_losses(strategy, single_device_losses):
    if strategy not in tiny_zero.STRATEGIES:
        pytest.skip(f"tiny_zero.{strategy} is not there yet")
    assert len(single_device_losses) == 4
    two_ranks = losses(torchrun(strategy, *TINY, "--steps", "4", "--batch-size", "2"))
    assert two_ranks == pytest.approx(single_device_losses, rel=1e-5, abs=0)


@pytest.mark.slow
def test_tensor_parallel_prints_the_single_device_losses(single_device_losses):
    """example/tensor at 2 ranks is one replica: it takes the whole batch of 4."""
    two_ranks = losses(torchrun("tensor", *TINY, "--steps", "4", "--batch-size", "4"))
    assert two_ranks == pytest.approx(single_device_losses, rel=1e-5, abs=0)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_parallel_prints_the_single_device_losses(method, single_device_losses):
    """example/context at 2 ranks is one replica: each rank keeps half of every sequence of the batch of 4."""
    out = torchrun("context", *TINY, "--steps", "4", "--batch-size", "4", "--method", method)
    assert losses(out) == pytest.approx(single_device_losses, rel=1e-5, abs=0)
    sent = re.search(r"collective sizes: (.*) elements", out).group(1)
    assert re.search(r"tiny_zero.measure.estimate: (.*) elements", out).group(1) == sent  # the estimate is exact


@pytest.mark.slow
def test_context_parallel_activations_are_the_estimate_and_half_of_one_rank():
    """docs/context.md's run: 24 MiB hold a rank's half of each sequence, not the whole (refused at --cp-size 1)."""
    flags = ["--model", "small", "--seq-len", "128", "--batch-size", "8", "--steps", "1", "--eval-batches", "1",
             "--max-activation-mib", "24"]
    out = torchrun("context", *flags)
    measured = re.search(r"measured \(first step, tiny_zero.measure.memory\): (.*)", out).group(1)
    assert re.search(r"estimate: (\S+ MiB) at --cp-size 2; .* \(--cp-size 1\) (\S+ MiB), 2.00x", out).groups() == \
        (measured, "36.15 MiB")
    refused = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                  script("context"), *flags, "--cp-size", "1")
    assert refused.returncode != 0 and "36.15 MiB of activations per rank (estimated)" in refused.stderr


def test_context_parallel_refuses_a_run_over_the_activation_budget():
    with pytest.raises(SystemExit, match=r"over --max-activation-mib 0.5: split each sequence"):
        run_in_process("context", *TINY, "--steps", "1", "--cp-size", "1", "--max-activation-mib", "0.5")


@pytest.mark.skipif("zero3" not in tiny_zero.STRATEGIES, reason="tiny_zero.zero3 is not there yet")
def test_readme_main_command():
    """torchrun --nproc_per_node 2 example/zero3/train.py, shortened to 5 steps."""
    out = torchrun("zero3", "--steps", "5", "--eval-batches", "2")
    curve = losses(out)
    assert len(curve) == 5 and all(0 < x < 10 for x in curve), out
    assert "val loss" in out and "peak memory" in out


def test_missing_data_is_a_one_line_error(tmp_path):
    missing = tmp_path / "nowhere.txt"
    result = run(sys.executable, script("single_device"), "--data", str(missing), "--steps", "1")
    assert result.returncode != 0
    assert result.stderr.strip() == f"error: --data {missing}: no such file or folder"
    assert "step" not in result.stdout


@pytest.mark.parametrize("text, message", [(b"", "no text found"), (b"too short", "text too short")])
def test_unusable_data_is_a_one_line_error(tmp_path, capsys, text, message):
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    args = train_common.parse_args(argv=["--data", str(path), "--seq-len", "32"])
    with pytest.raises(SystemExit) as exit_info:
        train_common.load_data(args)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def one_device_and_two_ranks(flags, strategies):
    """The losses of example/single_device with a batch of 4, and of each
    strategy's example on 2 ranks with 2 each ({strategy: losses}), the
    strategies in one launch (tests/local_rank_check.py)."""
    single = losses(run_in_process("single_device", *flags, "--batch-size", "4"))
    result = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 str(ROOT / "tests" / "local_rank_check.py"), *map(script, strategies), "--",
                 *flags, "--batch-size", "2", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    parts = re.split(r"^== (\S+)$", result.stdout, flags=re.MULTILINE)
    return single, {Path(s).parent.name: losses(text) for s, text in zip(parts[1::2], parts[2::2])}


@pytest.mark.slow
def test_every_example_trains_the_llama():
    """--model llama-tiny: every strategy on 2 ranks prints the losses of one device."""
    strategies = list(tiny_zero.STRATEGIES)
    single, curves = one_device_and_two_ranks(
        ["--model", "llama-tiny", "--seq-len", "32", "--eval-batches", "1", "--steps", "3"], strategies)
    assert list(curves) == strategies and len(single) == 3
    for strategy, curve in curves.items():
        assert curve == pytest.approx(single, rel=1e-5, abs=0), strategy


def test_learning_rate_warms_up_then_decays_along_a_cosine_to_a_tenth():
    args = train_common.parse_args(argv=["--steps", "100", "--lr", "1e-3"])
    assert args.warmup_steps == 10  # a tenth of --steps
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.lr)
    sched, lr = train_common.schedule(opt, args), []
    for _ in range(100):
        lr.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lr[0] == pytest.approx(1e-4) and lr[9] == lr[10] == pytest.approx(1e-3)
    assert lr[55] == pytest.approx(0.55e-3)  # half way down the cosine
    assert all(a > b for a, b in zip(lr[10:], lr[11:])) and lr[99] == pytest.approx(1e-4, rel=1e-2)


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_weight_decay_only_on_matrices(name):
    args = train_common.parse_args(argv=["--model", name, "--seq-len", "32", "--weight-decay", "0.2"])
    module = train_common.build_model(args)
    decay, no_decay = train_common.param_groups(module, args)
    assert decay["weight_decay"] == 0.2 and no_decay["weight_decay"] == 0.0
    names = {p: n for n, p in module.named_parameters()}
    assert {names[p] for p in decay["params"]} == {n for n, p in module.named_parameters() if p.dim() == 2}
    assert all(n.endswith(("bias", "norm.weight")) or ".ln_" in n or n.startswith("ln_")
               for n in (names[p] for p in no_decay["params"]))
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)


@pytest.mark.slow
def test_expert_parallel_prints_the_single_device_losses():
    """example/experts at 2 ranks (2 rows each, experts split over both) prints
    what one device prints on the 4 rows: the cross-entropy with the whole
    batch's load-balancing loss; and its all-to-alls are the estimate's."""
    flags = ["--model", "moe-tiny", "--seq-len", "32", "--eval-batches", "2", "--steps", "4"]
    one = losses(run_in_process("single_device", *flags, "--batch-size", "4"))
    out = torchrun("experts", *flags, "--batch-size", "2")
    assert len(one) == 4 and losses(out) == pytest.approx(one, rel=1e-5, abs=0)
    sent = re.search(r"the ranks' mean: ([\d,]+) elements; tiny_zero.measure.estimate ([\d,]+)", out)
    assert sent and sent.group(1) == sent.group(2), out[-2000:]
