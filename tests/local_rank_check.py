"""Run under torchrun in place of example scripts:

    torchrun ... tests/local_rank_check.py example/zero3/train.py example/fsdp/train.py -- --model tiny ...

First prints which CUDA device tiny_zero would give this worker (with
torch.cuda made to look present: this machine has none). On the second of
two nodes RANK is 2 or 3 while LOCAL_RANK is 0 or 1: the device must follow
LOCAL_RANK. Then runs each example in turn, unchanged, with the flags after
`--` (one launch instead of one per example: starting processes is the slow
part on 2 cores); rank 0 prints `== SCRIPT` before each. The first example
creates the process group and the others use it, so it is destroyed once,
after the last example, whatever the examples do at their end.
"""
import os
import runpy
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_zero import distributed  # noqa: E402


def device_choice():
    chosen = []
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=8), \
            mock.patch.object(torch.cuda, "set_device", side_effect=chosen.append):
        device = distributed.local_device()
    return device, chosen


def main():
    device, chosen = device_choice()
    env = " ".join(f"{key}={os.environ[key]}" for key in ("RANK", "LOCAL_RANK", "GROUP_RANK"))
    print(f"worker {env} device {device} set_device {[str(d) for d in chosen]}", flush=True)
    split = sys.argv.index("--")
    scripts, flags = sys.argv[1:split], sys.argv[split + 1:]
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    try:
        for script in scripts:
            if os.environ["RANK"] == "0":
                print(f"== {script}", flush=True)
            sys.argv = [script, *flags]
            runpy.run_path(script, run_name="__main__")
    finally:
        dist.destroy_process_group = destroy
    destroy()


if __name__ == "__main__":
    main()
