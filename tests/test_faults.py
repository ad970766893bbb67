"""Faults, tried on purpose on the example scripts.

Elastic restart: torchrun --max-restarts 1 runs example/zero2/train.py with
--save-every and --resume; the test SIGKILLs one worker after the first
checkpoint; torchrun restarts the group, which resumes from the last
checkpoint, and the run ends with the same parameters, bit for bit, and the
same per-step losses as a run that was never interrupted.

Non-finite loss: a learning rate far too large makes the loss inf/nan within
a few steps; the example stops with an error naming the step, on every rank,
or with --skip-nonfinite skips those steps and says how many.

A peer that dies: the surviving rank's error names what it was doing
(full_state_dict) and says the collective failed at once, not after the
timeout.

A run that fails ends in seconds: under torchrun, one rank raises, leaves
early or stalls past the collective timeout; every process is gone within
30 s of it, each other rank with a non-zero code and its error printed.
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
sys.path.insert(0, str(ROOT))

from tiny_zero.checkpoint import consolidate  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TINY = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "0"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STEPS, SAVE_EVERY = 40, 5
STEPS_DIVERGING = 6
DIVERGING = ["--steps", str(STEPS_DIVERGING), "--lr", "1e3", "--weight-decay", "10"]  # weights grow ~1e4 times a step: the loss turns nan


def script(strategy):
    return str(ROOT / "example" / strategy / "train.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(stdout):
    """{step: the printed loss} (a step printed twice, before and after a restart, keeps the last)."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+) loss (\S+)$", stdout, re.MULTILINE)}


class Launched:
    """A command in its own process group, output to files; killed with its
    whole group (the agent and its workers) if the test ends before it does."""

    def __init__(self, command, log_dir, name, env=ENV):
        self.out_path, self.err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err,
                                         start_new_session=True)

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"ran over {timeout} s:\n{self.output()}") from None

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    @property
    def stdout(self):
        return self.out_path.read_text()

    def output(self):
        return f"{self.stdout}\n--- stderr (end) ---\n{self.err_path.read_text()[-4000:]}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def workers(agent_pid):
    """{RANK: pid} of the processes the torchrun agent started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
        if parent == agent_pid:
            rank = next((v[5:].decode() for v in env if v.startswith(b"RANK=")), None)
            if rank is not None:
                found[int(rank)] = int(entry.name)
    return found


def wait_for(condition, timeout, what, launched):
    deadline = time.monotonic() + timeout
    while not condition():
        if launched.proc.poll() is not None:
            raise AssertionError(f"ended (exit {launched.proc.returncode}) before {what}:\n{launched.output()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s:\n{launched.output()}")
        time.sleep(0.01)


@pytest.mark.slow
def test_elastic_restart_after_a_killed_worker_resumes_bit_identically(tmp_path):
    flags = [*TINY, "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    with Launched([*TORCHRUN, "--standalone", "--nproc_per_node", "2", script("zero2"), *flags,
                   "--save-dir", str(tmp_path / "uninterrupted")], tmp_path, "uninterrupted") as reference:
        assert reference.wait(timeout=180) == 0, reference.output()
    expected = losses(reference.stdout)
    assert sorted(expected) == list(range(STEPS))

    save_dir = tmp_path / "killed"
    command = [*TORCHRUN, "--nproc_per_node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "faults",
               script("zero2"), *flags, "--save-dir", str(save_dir), "--resume"]
    # torchrun's c10d rendezvous shares one TCP store with the workers, across restarts, without
    # a per-restart prefix (pytorch/pytorch#135712): a restarted gloo group can read the dead
    # workers' addresses and fail ("Connection refused") or hang. Opting out gives each restart
    # a fresh store.
    env = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with Launched(command, tmp_path, "killed", env) as run:
        wait_for(lambda: (save_dir / "meta.pt").exists(), 120, "first checkpoint", run)
        pids = workers(run.proc.pid)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGKILL)
        assert run.wait(timeout=180) == 0, run.output()
    out = run.stdout

    resumed = re.findall(rf"^resumed from {re.escape(str(save_dir))} at step (\d+)$", out, re.MULTILINE)
    assert len(resumed) == 1, out  # the first attempt found nothing to resume; the restart did
    step = int(resumed[0])
    assert SAVE_EVERY <= step < STEPS and step % SAVE_EVERY == 0, out
    assert out.index("step 0 loss") < out.index("resumed from"), out  # the kill came mid-run
    assert losses(out) == expected  # every step, those redone after the restart included

    final, full = consolidate(save_dir), consolidate(tmp_path / "uninterrupted")
    assert list(final) == list(full)
    different = [key for key in full if not torch.equal(final[key], full[key])]
    assert not different, f"not bit-identical after the restart: {different}"


def run_diverging(tmp_path, *flags):
    """zero3 on 2 ranks with DIVERGING: (exit status, stdout, stderr)."""
    command = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", script("zero3"), *TINY, *DIVERGING, *flags]
    with Launched(command, tmp_path, "diverging") as run:
        status = run.wait(timeout=120)
    return status, run.stdout, run.err_path.read_text()


@pytest.mark.slow
def test_nonfinite_loss_stops_naming_the_step(tmp_path):
    status, out, err = run_diverging(tmp_path)
    assert status != 0
    # each rank's error, split where two ranks' writes ran into one line
    errors = set(re.findall(r"error: .*?instead|error: (?!the loss).*$", err, re.MULTILINE))
    # every rank stops at the same step (torchrun may end one before it prints: one line or two)
    assert len(errors) == 1, err[-3000:]
    step = re.fullmatch(r"error: the loss is not finite at step (\d+) \(on some rank\); "
                        r"--skip-nonfinite skips such steps instead", errors.pop())
    assert step, err[-3000:]
    assert 0 < int(step.group(1)) < STEPS_DIVERGING
    assert sorted(losses(out)) == list(range(int(step.group(1))))  # it stopped there, before any update


@pytest.mark.slow
def test_skip_nonfinite_skips_and_counts(tmp_path):
    status, out, err = run_diverging(tmp_path, "--skip-nonfinite")
    assert status == 0, err[-3000:]
    skipped = STEPS_DIVERGING - len(losses(out))  # a step prints its loss only when it trains
    assert 0 < skipped < STEPS_DIVERGING, out
    assert re.search(rf"^skipped {skipped} steps with a non-finite loss$", out, re.MULTILINE), out


@pytest.mark.slow
def test_a_dead_peer_is_told_where_and_at_once(tmp_path):
    """Rank 1 dies after an optimizer step; rank 0 then calls
    full_state_dict (fsdp: a collective). Two plain processes, not torchrun,
    whose agent could stop rank 0 before it prints."""
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [Launched([sys.executable, __file__, "peer-dies"], tmp_path, f"rank{rank}", {**env, "RANK": str(rank)})
             for rank in range(2)]
    for rank in ranks:
        rank.__enter__()
    try:
        assert ranks[0].wait(timeout=120) == 0, ranks[0].output()
        assert ranks[1].wait(timeout=30) == 3, ranks[1].output()
    finally:
        for rank in ranks:
            rank.kill()
    error = ranks[0].stdout
    assert re.search(r"^CollectiveError: .*waited for in full_state_dict, failed after \d+\.\d s of waiting: ",
                     error, re.MULTILINE), error
    assert float(re.search(r"failed after (\S+) s", error)[1]) < 60, error


def peer_dies_in_full_state_dict():
    """Each rank of test_a_dead_peer_is_told_where_and_at_once."""
    import torch.distributed as dist

    import tiny_zero
    sys.path.insert(0, str(ROOT / "tests"))
    from parity_checks import ParityNet
    dist.init_process_group("gloo")
    model = tiny_zero.STRATEGIES["fsdp"][0](ParityNet())
    opt = tiny_zero.STRATEGIES["fsdp"][1](model, lr=1e-2)
    tokens = torch.randint(0, 13, (2, 8))
    model(tokens, tokens).backward()
    opt.step()
    if dist.get_rank() == 1:
        os._exit(3)
    try:
        model.full_state_dict()
        print("full_state_dict returned")
    except Exception as e:
        print(f"{type(e).__name__}: {e}")
    sys.stdout.flush()
    os._exit(0)  # no teardown of a group whose peer has gone


FAILED_RUNS = [(name, "stall") for name in ("ddp", "zero1", "zero2", "zero3", "fsdp", "offload")] + \
              [("zero3", "raise"), ("zero2", "leave")]


@pytest.mark.slow
@pytest.mark.parametrize("name,case", FAILED_RUNS)
def test_a_failed_run_ends_in_seconds_on_every_rank(name, case, tmp_path):
    """tests/failed_run_check.py under torchrun: rank 1 raises, leaves or
    stalls at step 2. Each other rank's collective fails (at once, or at
    the 3 s timeout), and its process must end within 30 s of rank 1's act,
    non-zero, with its error printed; torchrun stops the rest. Before,
    gloo's teardown waited in a collective that never ends (30 minutes)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    command = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", str(ROOT / "tests" / "failed_run_check.py"),
               name, case]
    with Launched(command, tmp_path, "run", {**ENV, "PID_DIR": str(pids)}) as run:
        code = run.wait(timeout=90)
        ended = time.time()
    out, err = run.stdout, run.err_path.read_text()
    acted = float(re.search(r"acting at (\S+)", out)[1])
    assert ended - acted < 30, f"ended {ended - acted:.0f} s after rank 1 acted:\n{run.output()}"
    assert code != 0 and "no error" not in out, run.output()
    codes = {int(rank): int(code) for rank, code in
             re.findall(r"rank\s*: (\d+) \(local_rank.*\n\s*exitcode\s*: (-?\d+)", err)}
    assert codes.get(0, 0) != 0, f"rank 0 exited 0:\n{run.output()}"
    assert ("CollectiveError" if case != "raise" else "ValueError: rank 1 raises on purpose") in err, run.output()
    for pid in pids.iterdir():  # no worker is left behind torchrun
        assert not Path(f"/proc/{pid.name}").exists(), f"process {pid.name} still runs:\n{run.output()}"


if __name__ == "__main__" and sys.argv[1:] == ["peer-dies"]:
    peer_dies_in_full_state_dict()
