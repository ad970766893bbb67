"""The GPU scripts' logic, on the CPU with tiny sizes. example/benchmark/gpu.py:
both tables, every run, the formula and the reference figures it states, and
every run training the same model on the same batch. profile_gpu.py: its
tables and traces, and its reading of a trace's kernels. gpu_check.sh: it
parses, and runs its steps in order. Also the CPU benchmarks host.py,
layers.py and units.py."""
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tiny_zero

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RUNS = ["torch", "torch_ddp", "torch_fsdp2", "single_device", *tiny_zero.STRATEGIES]


def run_tiny(runs=RUNS):
    code = ("import runpy; main = runpy.run_path('example/benchmark/gpu.py')['main']; "
            f"main(sizes=(1000, 4099), models=('tiny',), runs={tuple(runs)!r}, batch=2, seq_len=16, warmup=1, steps=2)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def table_rows(text, first_cell):
    """The cells of each markdown row whose first cell matches `first_cell`."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]
    return [r for r in rows if re.fullmatch(first_cell, r[0])]


@pytest.mark.slow
def test_gpu_script_on_cpu():
    out = run_tiny()
    assert out.startswith("no GPU (CPU); torch ")

    kernel = table_rows(out, r"[\d,]+")
    assert [r[0] for r in kernel] == ["1,000", "4,099"]
    for r in kernel:
        assert all(float(c.rstrip("x%")) > 0 for c in r[1:]), r  # every figure measured

    models = {r[0]: r for r in table_rows(out, "|".join(RUNS))}
    assert list(models) == RUNS
    assert models["torch"][5] == "1.00"  # the baseline against itself
    assert all(r[4] == "n/a" for r in models.values())  # no CUDA memory on a CPU
    losses = [float(r[-1]) for r in models.values()]
    assert max(abs(loss - losses[0]) for loss in losses) < 1e-2 * losses[0]  # same model, same batch

    assert "torch.autocast(bfloat16), torch.optim.AdamW(fused=True)" in out
    assert "6·N·tokens + 12·layers·width·seq_len·tokens" in out and "989 TFLOP/s" in out
    assert "gpt2-large: 17.35 GB" in out


@pytest.mark.slow
def test_gpu_script_runs_what_it_is_asked_with_torch_as_the_baseline():
    """--runs (here through main's runs=): only those, after torch; the command line parses."""
    models = {r[0]: r for r in table_rows(run_tiny(["zero3", "torch_fsdp2"]), "|".join(RUNS))}
    assert list(models) == ["torch", "zero3", "torch_fsdp2"]
    assert models["torch"][5] == "1.00" and float(models["zero3"][5]) > 0
    help_text = subprocess.run([sys.executable, "example/benchmark/gpu.py", "--help"], cwd=ROOT, capture_output=True,
                               text=True, timeout=60).stdout
    assert "--models" in help_text and "--runs" in help_text


def test_step_summary_reads_kernels_copies_and_idle_time_from_a_trace():
    """A step from 100 us to 150 us on the host whose device work ends at 300:
    wall 200 us; kernels at 110-160 and 140-200 overlap (busy 90 us, not 110),
    a copy at 250-300 adds 50; work that ended before the step is not counted."""
    from example.benchmark.profile_gpu import covered, step_summary
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "step", "ts": 100, "dur": 50},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "step", "ts": 105, "dur": 195},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 101, "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 110, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "adamw", "ts": 140, "dur": 60},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 250, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "before", "ts": 10, "dur": 20},
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 101},
    ]
    summary = step_summary({"traceEvents": events})
    assert summary == {"wall_us": 200, "host_us": 50, "busy_us": 140, "kernels": [("gemm", 50), ("adamw", 60)]}
    assert covered([(0, 10), (5, 20), (30, 40), (31, 32)]) == 30


@pytest.mark.slow
def test_profile_script_on_cpu(tmp_path):
    """CPU activity only, a tiny model: a section per run, the summary with
    torch as the baseline, and one step's trace per run, which Perfetto reads
    (gzipped Chrome JSON with the step in it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "example/benchmark/profile_gpu.py", "--out", str(tmp_path), "--model",
                             "tiny", "--batch-size", "2", "--seq-len", "16", "--warmup", "1", "--timed", "2",
                             "--profiled", "2", "--runs", "single_device", "ddp"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.findall(r"^### (\S+)$", out, re.MULTILINE) == ["torch", "single_device", "ddp"]
    assert len(re.findall(r"^\| top 15 operators by self CPU time", out, re.MULTILINE)) == 3
    summary = {r[0]: r for r in table_rows(out.split("## tiny: summary")[1], "torch|single_device|ddp")}
    assert list(summary) == ["torch", "single_device", "ddp"]
    assert summary["torch"][2] == "1.00"
    assert all(float(r[1]) > 0 and float(r[3]) > 0 and float(r[5]) > 0 and r[6] == "0" for r in summary.values())
    for run in summary:
        with gzip.open(tmp_path / f"tiny_{run}.json.gz", "rt") as f:
            events = json.load(f)["traceEvents"]
        assert any(e.get("name") == "step" and e.get("cat") == "user_annotation" for e in events)
        assert any(e.get("cat") == "cpu_op" and e.get("name") == "aten::mm" for e in events)


def test_gpu_check_script_parses_and_runs_its_steps_in_order(tmp_path):
    """bash -n; then, with each step's command replaced by one that prints its
    name (GPU_CHECK_DRY_RUN=1), every step runs in order under its timeout and
    the statuses close the log."""
    script = ROOT / "example" / "benchmark" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    result = subprocess.run(["bash", str(script), str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "GPU_CHECK_DRY_RUN": "1"}, timeout=60)
    assert result.returncode == 0, result.stderr
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    steps = ["nvidia-smi", "versions", "cuda-tests", "gpu.py", "profile_gpu.py", "offload-cuda-tests"]
    assert re.findall(r"^== (\S+) \(at most \d+ s\): ", log, re.MULTILINE) == steps, log
    assert re.findall(r"^(\S+): exit 0", log, re.MULTILINE) == steps, log


@pytest.mark.slow
def test_layers_script_compares_the_same_training():
    """example/benchmark/layers.py: both sides train the same model on the same
    batch (equal losses), torch is its own baseline, every time measured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "example/benchmark/layers.py", "--model", "tiny", "--batch-size", "2",
                             "--seq-len", "16", "--steps", "2", "--warmup", "1", "--repeat", "2"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r[0]: r for r in table_rows(result.stdout, "torch|tiny_zero")}
    assert list(rows) == ["torch", "tiny_zero"]
    assert rows["torch"][2] == rows["torch"][3] == rows["torch"][5] == "1.000"
    assert all(float(rows[side][4]) > 0 for side in rows)
    assert abs(float(rows["torch"][6]) - float(rows["tiny_zero"][6])) < 1e-4 * float(rows["torch"][6])


@pytest.mark.slow
def test_host_script_times_every_run_on_the_same_training():
    """example/benchmark/host.py: torch, single_device and every strategy at
    world 1 train the same model on the same batch (equal losses), with the
    blocks of --model, and torch is its own baseline."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "example/benchmark/host.py", "--model", "small", "--steps", "2",
                             "--warmup", "1", "--repeat", "1"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("--model small: 4 blocks at width 16"), result.stdout
    rows = {r[0]: r for r in table_rows(result.stdout, "|".join(RUNS))}
    assert list(rows) == RUNS
    assert rows["torch"][2] == "1.00"
    assert all(float(r[1]) > 0 for r in rows.values())
    losses = [float(r[3]) for r in rows.values()]
    assert max(abs(loss - losses[0]) for loss in losses) < 1e-5 * losses[0], losses


@pytest.mark.slow
def test_units_script_trades_collectives_for_memory_on_the_same_training():
    """example/benchmark/units.py at 2 ranks: zero3 and fsdp with units of a
    block send fewer collectives than with a unit per layer, every run
    counts its memory and time, and all four compute the same losses."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "example/benchmark/units.py", "--model", "tiny", "--batch-size", "2", "--steps", "2",
                             "--repeat", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {(r[0], r[1]): r for r in table_rows(result.stdout, "zero3|fsdp")}
    assert list(rows) == [("zero3", "block"), ("zero3", "layer"), ("fsdp", "block"), ("fsdp", "layer")]

    def calls(cell):
        return sum(int(part.split()[0]) for part in cell.split(", "))
    for strategy in ("zero3", "fsdp"):
        assert calls(rows[strategy, "block"][2]) < calls(rows[strategy, "layer"][2]), result.stdout
    assert all(float(r[3]) > 0 and float(r[5]) > 0 for r in rows.values())
    losses = [float(r[6]) for r in rows.values()]
    assert max(abs(loss - losses[0]) for loss in losses) < 1e-5 * losses[0], losses
