"""One rank of a run that fails, started by torchrun from
tests/test_faults.py: `failed_run_check.py STRATEGY CASE`. At step 2, rank 1:

    raise   raises an error of its own (the others wait in a collective)
    leave   ends its script early, exit 0 (a rank with fewer batches)
    stall   sleeps past the others' collective timeout (3 s)

Each rank writes its pid into $PID_DIR, and rank 1 prints when it acts, so
the test can time every process's end from there. The script does nothing to
help its own exit: no os._exit, no destroy_process_group."""
import os
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tiny_zero  # noqa: E402
from parity_checks import ParityNet  # noqa: E402
from tiny_zero import comm  # noqa: E402

STALL_SECONDS = 120


def main():
    name, case = sys.argv[1:3]
    comm.set_timeout(3)
    model = tiny_zero.STRATEGIES[name][0](ParityNet())
    opt = tiny_zero.STRATEGIES[name][1](model, lr=1e-2)
    rank = dist.get_rank()
    (Path(os.environ["PID_DIR"]) / str(os.getpid())).touch()
    tokens = torch.randint(0, 13, (2, 8))
    for step in range(4):
        if step == 2 and rank == 1:
            print(f"acting at {time.time()}", flush=True)
            if case == "raise":
                raise ValueError("rank 1 raises on purpose")
            if case == "leave":
                return
            time.sleep(STALL_SECONDS)
        model(tokens, tokens).backward()
        opt.step()
        opt.zero_grad()
    print("no error")


if __name__ == "__main__":
    main()
