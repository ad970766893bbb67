"""Run a function on N gloo ranks (spawned processes) and collect the results.

Spawning is slow on 2 cores, so one world runs many checks: the function
returns a list of results from every rank, and the test asserts on them.
An exception on any rank fails the test with that rank's traceback.
Also a check that several worlds' check modules share
(module_state_dict_failures).
"""
import atexit
import faulthandler
import os
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def _worker(rank, world_size, store_dir, module_name, fn_name, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS="1")
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    out = Path(store_dir) / f"result{rank}.pkl"
    faulthandler.enable()  # a crash in C++ (an abort, a segfault) still shows where Python was
    atexit.register(_nothing_left_in_flight)  # before tiny_zero is imported: runs after its own exit handler
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store_dir}/store",
                                rank=rank, world_size=world_size)
        fn = getattr(__import__(module_name, fromlist=[fn_name]), fn_name)
        result = ("ok", fn(*args))
        dist.destroy_process_group()
    except BaseException:
        out.write_bytes(pickle.dumps(("error", traceback.format_exc())))
        os._exit(1)  # a non-zero exit makes the parent stop the other ranks at once
    out.write_bytes(pickle.dumps(result))
    # The exit handlers (tiny_zero's, then the check above), and no more: the
    # interpreter's teardown after a gloo world can abort in torch's C++ now
    # and then ("terminate called without an active exception", no Python
    # frame; torch's own gloo tests have seen it too), long after the result.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _nothing_left_in_flight():
    """At exit: tiny_zero holds no collective any more (one freed in the
    interpreter's teardown can abort the process); fail the rank if it does."""
    agreements = sys.modules.get("tiny_zero.agreements")
    if agreements is not None and agreements._unsettled:
        print(f"{len(agreements._unsettled)} agreements of tiny_zero still held at exit", file=sys.stderr)
        os._exit(70)


def run_world(world_size, module_name, fn_name, *args, timeout=300):
    """fn(*args) on every rank; returns the list of per-rank return values."""
    with tempfile.TemporaryDirectory() as store_dir:
        ctx = mp.start_processes(_worker, args=(world_size, store_dir, module_name, fn_name, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise TimeoutError(f"{fn_name} on {world_size} ranks ran over {timeout} s")
        except mp.ProcessExitedException as exited:  # the failed rank's traceback is read below
            first = exited
        else:
            first = None
        paths = [Path(store_dir) / f"result{rank}.pkl" for rank in range(world_size)]
        outcomes = [pickle.loads(path.read_bytes()) if path.exists() else None for path in paths]
        for rank, outcome in enumerate(outcomes):  # the rank that failed first: the others were stopped
            if outcome is not None and outcome[0] == "error":
                raise RuntimeError(f"rank {rank} failed:\n{outcome[1]}")
        if first is not None and outcomes[first.error_index] is not None:
            raise RuntimeError(f"rank {first.error_index} returned its result, then its process failed on "
                               f"the way out ({first}); the other ranks were stopped")
        for rank, outcome in enumerate(outcomes):
            if outcome is None:
                raise RuntimeError(f"rank {rank} died without a result")
        return [value for _, value in outcomes]


def run_checks(world_size, module_name, plan, timeout=300):
    """Many checks in one spawned world: plan = [(key, function name, args)]
    from module `module_name`; returns {key: [result on rank 0, rank 1, ...]}."""
    per_rank = run_world(world_size, "harness", "_checks", module_name, plan, timeout=timeout)
    return {key: [rank[key] for rank in per_rank] for key, _, _ in plan}



def check_failures(results, refusals=None):
    """results from run_checks: each check's per-rank failure lists are
    empty, and each key of `refusals` ({key: text}) got, on every rank, an
    error message containing its text."""
    refusals = refusals or {}
    for key, per_rank in results.items():
        if key in refusals:
            assert all(refusals[key] in message for message in per_rank), per_rank
        else:
            for rank, failures in enumerate(per_rank):
                assert not failures, f"{key}, rank {rank}: {failures}"

def _checks(module_name, plan):
    module = __import__(module_name)
    return {key: getattr(module, fn)(*args) for key, fn, args in plan}


def module_state_dict_failures(model, values):
    """For a wrapper whose module holds only a rank's part of each parameter
    (zero3, fsdp, tensor, pipeline): model.module.load_state_dict(values),
    keyed as the module's own, sets what model.full_state_dict() gives, and
    model.module.state_dict() raises rather than return the parts."""
    import torch
    model.module.load_state_dict(values)
    failures = [f"{k}: model.module.load_state_dict did not set it" for k, v in model.full_state_dict().items()
                if not torch.equal(v, values[k])]
    try:
        model.module.state_dict()
        failures.append("model.module.state_dict() returned what this rank holds")
    except RuntimeError as e:
        if "model.state_dict()" not in str(e):
            failures.append(f"model.module.state_dict(): unclear error {str(e)[:200]}")
    return failures
