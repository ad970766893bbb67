"""torch's training-loop semantics hold on every strategy (issue: no silent
wrong numbers). Against single-process torch, at world 2 and 3: frozen and
never-used parameters never move and are never sent; a layer used on
alternate steps, param groups (no decay on 1-D parameters, another lr for the
embedding, given by parameter or by name) and a LambdaLR warm-up, with
eps=1 (the update is then about lr·g: any wrong average shows); two backward
passes without no_sync, and a forgotten zero_grad, accumulate as torch does.
At world 2: add_param_group, zero_grad(set_to_none=False), state dicts of the
model and the optimizer, p.grad (a replaced one too) and torch's clip_grad_norm_, fp16 with a plain
loss.backward(), autocast and torch.compile, grad hooks on the parameters and torch's
MemTracker as under torch DDP, a head whose output reaches the loss on
some ranks only as under torch DDP with find_unused_parameters, torch's amsgrad and maximize refused, named_parameters() as an optimizer's params, model.module.state_dict() and
load_state_dict() (torch's load hooks run), copy.deepcopy, a second backward through one forward refused, p.grad set
to None outside zero_grad(), torch.autograd.grad and create_graph refused,
evaluation under no_grad (on rank 0 alone too), a parameter used outside its
layer refused, grads read or added to after a clip, a parameter written in
place after wrapping. Ranks that disagree (no_sync on
one rank, a layer used on one rank, a parameter written in place on one rank,
an evaluation outside no_grad on rank 0 alone) end in tiny_zero's error on
every rank, and every process exits non-zero in time. A state dict saved by
rank 0 alone, as torch DDP's tutorial does: local under ddp, the same clear
error on every rank at once elsewhere."""
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import ROOT, run_checks  # noqa: E402

ALL = ["ddp", "zero1", "zero2", "zero3", "fsdp", "offload"]
LOOPS = ["plain", "two_backwards", "no_sync", "no_zero_grad"]
WORLD2 = [("loops", "training_loops", (ALL, LOOPS)),
          ("groups", "each", ("add_param_group_and_set_to_none_false", ALL)),
          ("state_dicts", "each", ("state_dicts", ALL)),
          ("grads", "each", ("grads_as_torch_sees_them", ALL)),
          ("fp16", "each", ("fp16_loss_backward", ALL)),
          ("autocast_compile", "each", ("autocast_and_compile", ALL)),
          ("agreements", "each", ("agreements_per_step", ALL)),
          ("requires_grad_changed", "each", ("requires_grad_changed_after_wrapping", ALL)),
          ("grad_hooks", "each", ("grad_hooks", ALL)),
          ("head_on_some_ranks", "each", ("head_on_some_ranks", ALL)),
          ("torch_options", "each", ("torch_options_refused", ALL)),
          ("module_state_dicts", "each", ("module_state_dicts", ALL)),
          ("named_parameters", "each", ("named_parameters_given", ALL)),
          ("load_hooks", "each", ("load_state_dict_hooks", ALL)),
          ("deepcopy", "each", ("deep_copied", ALL)),
          ("second_backward", "each", ("second_backward_refused", ALL)),
          ("grads_cleared", "each", ("grads_cleared_outside_zero_grad", ALL)),
          ("autograd_grad", "each", ("autograd_grad_refused", ALL)),
          ("eval", "each", ("eval_under_no_grad", ALL)),
          ("outside_its_layer", "each", ("parameter_used_outside_its_layer", ALL)),
          ("clipping", "each", ("clipping_as_torch", ALL)),
          ("grad_scaler", "each", ("grad_scaler", ALL)),
          ("converted", "each", ("converted_after_wrapping", ALL)),
          ("in_place_writes", "each", ("in_place_writes", [n for n in ALL if n != "zero3"])),
          ("no_sync_then_step", "each", ("step_after_only_no_sync", ["zero1"]))]


@pytest.fixture(scope="module")
def world2():
    return run_checks(2, "semantics_checks", WORLD2, timeout=600)


@pytest.mark.parametrize("check", [key for key, _, _ in WORLD2])
def test_world_2(world2, check):
    failures = [f for rank in world2[check] for f in rank]
    assert not failures, "\n".join(failures[:30])


@pytest.mark.slow
def test_world_3_uneven_shards():
    results = run_checks(3, "semantics_checks", [("loops", "training_loops", (ALL, ["plain", "two_backwards"]))],
                         timeout=600)
    failures = [f for rank in results["loops"] for f in rank]
    assert not failures, "\n".join(failures[:30])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TIMEOUT = 4  # seconds, the collective timeout in these runs


DISAGREE = ([(name, case) for name in ALL for case in ("no_sync", "layer")] +
            [("ddp", "step"), ("zero1", "step"), ("zero3", "last_step"),  # ddp defers its step's check
             ("ddp", "write"), ("zero3", "write"), ("ddp", "skip"), ("zero2", "skip"),
             ("fsdp", "skip"), ("ddp", "save"), ("ddp", "clip"), ("zero2", "clip"),
             ("ddp", "rank0_eval"), ("zero2", "rank0_eval")])
QUICK_DISAGREE = [("zero2", "no_sync")]  # the quick tier's one; the full grid runs every case


@pytest.mark.parametrize("name,case", [case if case in QUICK_DISAGREE else pytest.param(*case, marks=pytest.mark.slow)
                                       for case in DISAGREE])
def test_ranks_that_disagree_all_fail_clearly_and_exit(name, case, tmp_path):
    outputs, reached = run_disagreeing(name, case, tmp_path)
    if case == "last_step":  # nothing is sent after it: told by the exit handler
        for rank, (code, out, err, ended) in enumerate(outputs):
            assert code == 0 and "no error" in out, f"rank {rank}:\n{out}\n{err[-2000:]}"
            assert "tiny_zero, at exit: ranks disagree on the optimizer step: parameters" in err, err[-3000:]
        return
    for rank, (code, out, err, ended) in enumerate(outputs):
        assert code != 0, f"rank {rank} exited 0:\n{out}\n{err[-2000:]}"
        assert "DisagreementError" in err or "CollectiveError" in err, f"rank {rank}:\n{err[-3000:]}"
        if case == "step":
            assert "ranks disagree on the optimizer step: parameters from" in err, f"rank {rank}:\n{err[-3000:]}"
        if case == "write":
            assert "parameters_written_in_place from 0 to 1" in err, f"rank {rank}:\n{err[-3000:]}"
        if case == "save":
            assert "ranks disagree on the optimizer step: parameters from" in err, f"rank {rank}:\n{err[-3000:]}"
            assert not any(tmp_path.iterdir()), "the checkpoint of replicas apart was written"
        if case == "rank0_eval":
            assert "a rank ran a forward that expects a backward (not under torch.no_grad()) that the others did " \
                "not run, or used other layers in it. Evaluate under torch.no_grad(), or on every rank" in err, \
                f"rank {rank}:\n{err[-3000:]}"
        if case in ("skip", "clip"):
            assert "DisagreementError: ranks disagree on what to check" in err, f"rank {rank}:\n{err[-3000:]}"
        assert ended - reached < TIMEOUT + 10, f"rank {rank} exited {ended - reached:.0f} s after the disagreement"


def run_disagreeing(name, case, tmp_path):
    """tests/disagree_check.py NAME CASE on two plain processes: [(exit code,
    stdout, stderr, when it ended)] per rank, and when the last reached step 2."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "TIMEOUT": str(TIMEOUT), "SAVE_DIR": str(tmp_path)}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "disagree_check.py"), name, case],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT + 120)
            outputs.append((p.returncode, out, err, time.time()))
    finally:
        for p in procs:
            p.kill()
    reached = max(float(re.search(r"reached step 2 at (\S+)", out).group(1)) for _, out, _, _ in outputs)
    return outputs, reached


@pytest.mark.slow
@pytest.mark.parametrize("name,case", [(name, case) for name in ALL
                                       for case in ("rank0_state_dict", "rank0_state_dict_no_barrier")])
def test_a_state_dict_on_rank_0_alone(name, case, tmp_path):
    """torch DDP's tutorial: rank 0 alone saves model.state_dict() mid-run,
    then dist.barrier() (or not). Under ddp the state dict is local: the run
    goes on and the file holds the values; elsewhere every rank raises the
    state dict's own error at once, naming the fix."""
    outputs, reached = run_disagreeing(name, case, tmp_path)
    for rank, (code, out, err, ended) in enumerate(outputs):
        if name == "ddp":
            assert code == 0 and "no error" in out, f"rank {rank}:\n{out}\n{err[-3000:]}"
        else:
            assert code != 0, f"rank {rank} exited 0:\n{out}\n{err[-2000:]}"
            assert "ranks disagree on a state dict of the model, which some ranks take and others do not" in err, \
                f"rank {rank}:\n{err[-3000:]}"
            assert ended - reached < TIMEOUT, f"rank {rank} exited {ended - reached:.0f} s after step 2"
    if name == "ddp":
        saved, held = torch.load(tmp_path / "model.pt"), torch.load(tmp_path / "module.pt")
        assert sorted(saved) == sorted(f"module.{k}" for k in held), sorted(saved)
        assert all(torch.equal(saved[f"module.{k}"], v) for k, v in held.items())
