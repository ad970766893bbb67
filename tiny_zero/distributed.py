"""The process group and the device every wrapper uses."""
import os
import socket

import torch
import torch.distributed as dist


def init_distributed():
    """Use the default process group; create one if there is none.

    Under torchrun the environment names the world; otherwise this process is a
    world of one. NCCL when CUDA is available, gloo otherwise."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, device_id=_cuda_device())
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1, device_id=_cuda_device())
    return dist.get_rank(), dist.get_world_size()


def local_device():
    """cuda:LOCAL_RANK when CUDA is available (never the global rank), else cpu."""
    return _cuda_device() or torch.device("cpu")


def _cuda_device():
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
