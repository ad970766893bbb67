"""example/benchmark/gpu.py's logic, on the CPU with tiny sizes: both tables,
every run, the formula and the reference figures it states, and every run
training the same model on the same batch."""
import os
import re
import subprocess
import sys
from pathlib import Path

import tiny_zero

ROOT = Path(__file__).resolve().parents[1]
RUNS = ["torch", "torch_ddp", "torch_fsdp2", "single_device", *tiny_zero.STRATEGIES]


def run_tiny():
    code = ("import runpy; main = runpy.run_path('example/benchmark/gpu.py')['main']; "
            "main(sizes=(1000, 4099), models=('tiny',), batch=2, seq_len=16, warmup=1, steps=2)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def table_rows(text, first_cell):
    """The cells of each markdown row whose first cell matches `first_cell`."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]
    return [r for r in rows if re.fullmatch(first_cell, r[0])]


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
