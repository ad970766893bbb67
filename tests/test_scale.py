"""Scale past one machine, and over time.

Multi-node: two torchrun agents on this machine act as two nodes of 2
processes each (c10d rendezvous on 127.0.0.1); zero3 and fsdp train and print
the same per-step losses as one 4-process run. Each worker also reports which
CUDA device tiny_zero would pick for it: cuda:LOCAL_RANK, never the global
rank (tests/local_rank_check.py; torch.cuda made to look present).

Large worlds by simulation: gpt2-xl on meta, wrapped as one rank of 8 under
torch's fake process group (example/benchmark/scale.py, whose full run at 8,
64 and 512 ranks is in docs/scale.md): the zero3 partition's balance, and the
bytes the rank holds against 16Ψ/N.

Soak: 100 steps of every strategy at world 3; the live tensor bytes between
steps stay the same after warm-up.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from harness import run_world  # noqa: E402
from tiny_zero import distributed  # noqa: E402

ALL = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TINY = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "0", "--steps", "3"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(stdout):
    return [float(m.group(1)) for m in re.finditer(r"^step \d+ loss (\S+)$", stdout, re.MULTILINE)]


def torchrun_together(runs, tmp_path, timeout=240):
    """Start every torchrun command line in `runs` at once (each in its own process
    group, output to files) and wait for all; returns their stdouts. All are
    killed, agents and workers, if one fails or runs over."""
    procs, logs = [], []
    try:
        for args in runs:
            n = len(list(tmp_path.glob("*.out")))  # torchrun_together may run more than once per test
            out, err = tmp_path / f"{n}.out", tmp_path / f"{n}.err"
            with open(out, "w") as o, open(err, "w") as e:
                procs.append(subprocess.Popen([*TORCHRUN, *args], cwd=ROOT, env=ENV, stdout=o, stderr=e,
                                              start_new_session=True))
            logs.append((out, err))
        deadline = time.monotonic() + timeout
        for p, (out, err) in zip(procs, logs):
            try:
                status = p.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"ran over {timeout} s: {p.args}\n{err.read_text()[-3000:]}") from None
            assert status == 0, f"{p.args}\n{out.read_text()}\n{err.read_text()[-3000:]}"
        return [out.read_text() for out, _ in logs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def per_example(stdout):
    """{script: its per-step losses} from tests/local_rank_check.py's output."""
    parts = re.split(r"^== (\S+)$", stdout, flags=re.MULTILINE)
    return {script: losses(text) for script, text in zip(parts[1::2], parts[2::2])}


@pytest.mark.slow
def test_two_nodes_of_two_train_as_one_run_of_four(tmp_path):
    examples = [str(ROOT / "example" / strategy / "train.py") for strategy in ("zero3", "fsdp")]
    check = [str(ROOT / "tests" / "local_rank_check.py"), *examples, "--", *TINY]
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes", *check]
             for node in (0, 1)]  # started together: the rendezvous waits for both
    stdout = "".join(torchrun_together(nodes, tmp_path))  # rank 0 prints the losses, on one node or the other
    single, = torchrun_together([["--standalone", "--nproc_per_node", "4", *check]], tmp_path)

    two_nodes, four = per_example(stdout), per_example(single)
    assert list(two_nodes) == list(four) == examples, stdout
    for example in examples:
        assert len(two_nodes[example]) == 3, stdout
        assert two_nodes[example] == pytest.approx(four[example], rel=1e-6, abs=0), example

    workers = re.findall(r"^worker RANK=(\d) LOCAL_RANK=(\d) GROUP_RANK=(\d) device (\S+) set_device \['(\S+)'\]$",
                         stdout, re.MULTILINE)
    assert sorted(workers) == [(str(r), str(r % 2), str(r // 2), f"cuda:{r % 2}", f"cuda:{r % 2}")
                               for r in range(4)], stdout


def test_device_follows_local_rank_not_rank(monkeypatch):
    """Global rank 3 is the second process on its node: cuda:1."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert distributed.uses_cuda()
    assert distributed.local_device() == torch.device("cuda", 1)
    assert chosen == [torch.device("cuda", 1)]


@pytest.mark.parametrize("local_rank", [0, 1])
def test_ranks_beyond_the_gpus_all_run_on_the_cpu(monkeypatch, capfd, local_rank):
    """torchrun --nproc_per_node 2 on a machine with one GPU: cuda:1 does not
    exist, and NCCL cannot put two ranks on one GPU, so both ranks of the
    machine (rank 0 too, whose cuda:0 exists) run on the CPU with gloo; local
    rank 0 says so in one line."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    distributed._say_on_cpu.cache_clear()
    assert not distributed.uses_cuda()
    assert distributed.local_device() == torch.device("cpu")
    assert chosen == []
    said = capfd.readouterr().err.strip().splitlines()
    expected = ["tiny_zero: 2 ranks on this machine but 1 GPU(s) visible: every rank runs on the CPU with gloo "
                "(start at most 1 ranks per machine to train on the GPUs)"]
    assert said == (expected if local_rank == 0 else [])


@pytest.mark.slow
def test_gpt2_xl_as_one_of_8_ranks():
    """zero3's partition is balanced to 0.03% at 8 ranks, and the most loaded
    rank holds 4 B of parameters and 8 B of AdamW state (exp_avg, exp_avg_sq) per element it owns
    and nothing else: with its grads, 16Ψ/N times the balance."""
    from example.benchmark.scale import balance, measure
    world = 8
    b = balance("gpt2-xl", world)
    assert b["numel"] == 1_557_686_400 and b["tensors"] == 580
    assert b["max_over_mean"] < 1.0003 and b["min_over_mean"] > 0.9999
    assert sum(b["loads"]) == b["numel"]

    rank = b["most_loaded"]
    owned = b["loads"][rank]
    held = measure("zero3", "gpt2-xl", world, rank, step=False)
    assert held["parameters"] == 4 * owned + 4  # and the one shared zero that released parameters expand
    assert held["optimizer_state"] == 8 * owned  # the step counts come with the first step
    assert held["gradients"] == held["comm_buffers"] == held["activations"] == held["other"] == 0
    state = held["parameters"] + held["optimizer_state"] + 4 * owned  # the grads of a step: one per owned element
    assert state == pytest.approx(16 * b["numel"] / world * b["max_over_mean"], rel=1e-6)


@pytest.mark.slow
def test_soak_100_steps_of_every_strategy_keeps_memory_flat():
    from scale_checks import WARMUP
    steps = 100
    for rank, per_strategy in enumerate(run_world(3, "scale_checks", "soak", ALL, steps, timeout=600)):
        for name, result in per_strategy.items():
            live = result["bytes"]
            assert len(live) == steps
            assert not result["leftovers"], (name, rank, result["leftovers"])
            # A storage whose collective has completed can be released a moment later by the
            # communication thread: the floor over a window is what must not move.
            early, late = min(live[WARMUP:WARMUP + 20]), min(live[-20:])
            assert late == early, f"{name} rank {rank}: {early} bytes after warm-up, {late} at the end"
            assert max(live[WARMUP:]) - early < result["model_bytes"], (name, rank, live)
