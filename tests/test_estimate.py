"""tiny_zero.measure.estimate against what the strategies really hold and send, and its CLI."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT))
from harness import run_world  # noqa: E402

import tiny_zero  # noqa: E402
from tiny_zero.measure import estimate  # noqa: E402
from example.model import build_model  # noqa: E402
from estimate_checks import BUCKET_BYTES  # noqa: E402

STRATEGIES = list(estimate.STRATEGIES)
PRECISIONS = [None, "bf16"]


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow) for n in (2, 4)], ids=lambda n: f"world{n}")
def measured(request):
    """One world per size: every strategy, fp32 and bf16, one step each."""
    n = request.param
    return n, run_world(n, "estimate_checks", "measure_all", STRATEGIES, PRECISIONS)


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p or "fp32")
@pytest.mark.parametrize("name", STRATEGIES)
def test_model_state_per_rank_matches_measured_bytes(measured, name, precision):
    n, ranks = measured
    expected = estimate.model_state(build_model("tiny", device="meta"), name, n, precision, BUCKET_BYTES)
    for rank, results in enumerate(ranks):
        r = results[(name, precision)]
        for category in estimate.CATEGORIES:  # each within 2% (they agree to the byte)
            assert r["held"][category] == pytest.approx(expected[rank][category], rel=0.02), (rank, category, r)
        # all live bytes: model state (and offload's pinned copy back), on the device and the host, plus the batch
        total = sum(estimate.placement(build_model("tiny", device="meta"), name, n, precision, BUCKET_BYTES)[rank].values())
        assert r["current"] == pytest.approx(total, rel=0.02), (rank, r["held"])


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p or "fp32")
@pytest.mark.parametrize("name", STRATEGIES)
def test_device_and_host_bytes_match_measured(measured, name, precision):
    """estimate.placement against TensorMemory.placement after a step: offload
    keeps all but its parameters (and the batch) in host memory, to the byte;
    the others keep nothing there."""
    n, ranks = measured
    expected = estimate.placement(build_model("tiny", device="meta"), name, n, precision, BUCKET_BYTES)
    for rank, results in enumerate(ranks):
        got = results[(name, precision)]["placement"]
        assert got["host"] == expected[rank]["host"], (rank, got)
        assert got["device"] == pytest.approx(expected[rank]["device"], rel=0.02), (rank, got)


@pytest.mark.parametrize("name", STRATEGIES)
def test_communication_per_step_matches_counted(measured, name):
    n, ranks = measured
    expected = estimate.comm_per_step(build_model("tiny", device="meta"), name, n, None, BUCKET_BYTES)
    for results in ranks:
        assert results[(name, None)]["sent"] == expected
    numel = sum(p.numel() for p in build_model("tiny", device="meta").parameters())
    transfers = estimate.transfers_per_rank(expected, n)
    theory = estimate.comm_theory(name, numel, n)
    assert theory <= transfers < theory * 1.15  # padding, and tied weights gathered per use


@pytest.mark.parametrize("name", STRATEGIES)
def test_breakdown_at_the_peak_and_in_backward(measured, name):
    """The peak's breakdown adds up to the peak; after forward what autograd
    saved counts as activations; while backward hands grads to buckets, the
    bucket (and what is gathered) counts as comm buffers and the parameters
    stay what the optimizer steps."""
    n, ranks = measured
    for results in ranks:
        r = results[(name, None)]
        assert sum(r["peak_breakdown"].values()) == r["peak"]
        assert r["after_forward"]["activations"] > 0
        assert r["after_forward"]["comm_buffers"] == 0  # nothing gathered is kept for backward
        if name in ("zero2", "zero3", "fsdp"):
            assert r["samples"], "no grad went through a bucket"
            assert max(s["comm_buffers"] for s in r["samples"]) >= r["biggest_bucket"]
            assert {s["parameters"] for s in r["samples"]} == {r["held"]["parameters"]}


def test_formula_and_owner_table_for_a_large_model():
    """gpt2-xl on 64 ranks, on the meta device: fsdp and zero1/2 are the
    formula up to padding; zero3's ranks average to it, the most loaded
    holds more (whole tensors); fp32 exp_avg and exp_avg_sq are 8 bytes, bf16 adds a master."""
    module = build_model("gpt2-xl", device="meta")
    numel = sum(p.numel() for p in module.parameters())
    for name in STRATEGIES:
        for precision in PRECISIONS:
            formula = sum(estimate.zero_formula(name, numel, 64, precision).values())
            ranks = [sum(r.values()) for r in estimate.model_state(module, name, 64, precision)]
            assert sum(ranks) / 64 == pytest.approx(formula, rel=1e-3), (name, precision)
            if name != "zero3":
                assert max(ranks) == pytest.approx(formula, rel=1e-3), (name, precision)
    zero3 = [sum(r.values()) for r in estimate.model_state(module, "zero3", 64)]
    assert max(zero3) >= 16 * numel / 64
    assert estimate.zero_formula("ddp", numel, 64)["optimizer_state"] == 8 * numel
    assert estimate.zero_formula("ddp", numel, 64, "bf16")["optimizer_state"] == 12 * numel


def test_default_bucket_size_is_the_wrappers():
    import inspect
    for name in ("ddp", "zero1", "zero2", "zero3"):
        wrapper_cls = tiny_zero.STRATEGIES[name][0]
        assert inspect.signature(wrapper_cls).parameters["bucket_bytes"].default == estimate.DEFAULT_BUCKET_BYTES


def mib(text):
    value, unit = text.split()
    return float(value) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_cli_gpt2_xl_zero3_on_64_ranks():
    out = subprocess.run([sys.executable, "-m", "tiny_zero.measure.estimate", "--model", "gpt2-xl", "--strategy", "zero3",
                          "--world-size", "64"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    numel = int(re.search(r"Ψ = ([\d,]+) parameters", out.stdout).group(1).replace(",", ""))
    assert numel == sum(p.numel() for p in build_model("gpt2-xl", device="meta").parameters())
    totals = {label: mib(total) for label, total in
              re.findall(r"^  (ZeRO formula|tiny_zero owner table, mean|tiny_zero owner table, rank \d+ \(most\))"
                         r".* (\d+\.\d+ [KMG]iB) +\d+\.\d+$", out.stdout, re.MULTILINE)}
    assert len(totals) == 3, out.stdout
    formula = totals["ZeRO formula"]
    assert formula == pytest.approx(16 * numel / 64, rel=1e-3)
    assert all(total >= formula * 0.999 for total in totals.values())
    assert re.search(r"broadcast +[\d,]+ elements", out.stdout) and re.search(r"reduce +[\d,]+ elements", out.stdout)
    assert "3Ψ(N-1)/N" in out.stdout


def test_llama_8b_on_8_ranks(capsys):
    """The Llama shapes: every parameter counted, its RMSNorm layers among the
    layers (fsdp's units, zero3's broadcasts), the fsdp share 16Ψ/N."""
    estimate.main(["--model", "llama-8b", "--strategy", "fsdp", "--world-size", "8"])
    out = capsys.readouterr().out
    assert "Ψ = 8,030,261,248 parameters" in out
    module = build_model("llama-8b", device="meta")
    assert len(estimate.layers(module)) == 32 * 9 + 3  # per block 7 Linear, 2 RMSNorm; embedding, norm, head
    assert estimate.comm_per_step(module, "fsdp", 8)["reduce_scatter"] == 8_030_261_248  # no padding needed


def test_cli_errors(capsys):
    with pytest.raises(SystemExit, match="unknown model 'gpt5'"):
        estimate.main(["--model", "gpt5"])
    with pytest.raises(SystemExit):
        estimate.main(["--model", "tiny", "--world-size", "0"])
    assert "--world-size must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_context_activations_match_the_tensors_a_forward_saves(name):
    """The estimate against what autograd saves in one forward of the example GPT (torch's attention, one process),
    counted by tiny_zero.measure.memory; exact but for the loss's scalars. Under context parallelism each rank
    holds tokens/C of every activation: the estimate falls as 1/C."""
    from tiny_zero.measure.memory import TensorMemory

    rows, tokens = 4, 64
    model = build_model(name)
    with TensorMemory() as memory:
        memory.attach(model)  # the parameters, which autograd saves too, count as parameters
        x, y = torch.randint(0, 256, (rows, tokens)), torch.randint(0, 256, (rows, tokens))
        loss = model(x, y)
        saved = memory.breakdown()["activations"]
    del loss
    whole = estimate.context_activations(model, rows, tokens, split_attention=False)
    assert 0 <= saved - whole <= 16, (saved, whole)
    split = estimate.context_activations(model, rows, tokens)
    assert [estimate.context_activations(model, rows, tokens, c) for c in (2, 4)] == [split // 2, split // 4]


def test_context_activations_are_for_the_example_gpt():
    with pytest.raises(ValueError, match="example GPT"):
        estimate.context_activations(build_model("llama-tiny", device="meta"), 1, 64)
    with pytest.raises(ValueError, match="do not split"):
        estimate.context_activations(build_model("tiny", device="meta"), 1, 64, 3)
