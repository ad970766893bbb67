"""The process group and the device every wrapper uses."""
import functools
import os
import socket
import sys

import torch
import torch.distributed as dist


def init_distributed():
    """Use the default process group; create one if there is none.

    Under torchrun the environment names the world; otherwise this process is a
    world of one. NCCL when the ranks use CUDA (uses_cuda), gloo otherwise."""
    if not dist.is_initialized():
        backend = "nccl" if uses_cuda() else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, device_id=_cuda_device())
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1, device_id=_cuda_device())
    return dist.get_rank(), dist.get_world_size()


def local_device():
    """cuda:LOCAL_RANK when the ranks use CUDA (never the global rank), else cpu."""
    return _cuda_device() or torch.device("cpu")


def uses_cuda():
    """CUDA is available and each rank on this machine has a GPU of its own.
    Where the ranks outnumber the visible GPUs (two ranks on a one-GPU laptop)
    every rank of the machine runs on the CPU with gloo: NCCL cannot put two
    ranks on one GPU, and all ranks of a machine must choose alike."""
    if not torch.cuda.is_available():
        return False
    ranks_here = max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)) + 1)
    gpus = torch.cuda.device_count()
    if ranks_here <= gpus:
        return True
    _say_on_cpu(ranks_here, gpus)
    return False


@functools.cache
def _say_on_cpu(ranks, gpus):
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(f"tiny_zero: {ranks} ranks on this machine but {gpus} GPU(s) visible: every rank runs on the CPU "
              f"with gloo (start at most {gpus} ranks per machine to train on the GPUs)", file=sys.stderr)


def _cuda_device():
    if not uses_cuda():
        return None
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
