"""Sharded checkpoints that reshard: save with any strategy and world size,
load with any other; and pretrained weights in, shard by shard.

    save(path, model, opt, step=..., extra={...})   every rank writes its part
    load(path, model, opt) -> {"step": ..., "extra": {...}}
    python -m tiny_zero.checkpoint consolidate PATH OUT [--format safetensors]
    load_pretrained(model, path)   a Hugging Face model directory, or a
                                   state_dict file (pretrained.py)

A checkpoint is a directory:

    meta.pt                    rank 0: the model's parameters (name, shape,
                               dtype), its state_dict keys (tied names
                               included), the optimizer's param groups (their
                               settings, their parameters by name), which
                               file holds which ranges, the step and `extra`
    shard-00000-of-00002.pt    one per saving rank: the elements it held

Every parameter is seen as a flat vector. A shard holds ranges [lo, hi) of
parameters, each as three fp32 tensors keyed by (name, lo, hi): the value
(the optimizer's fp32 master under mixed precision), exp_avg and exp_avg_sq,
plus the optimizer's step count for the range and the loss scaler's state.
model.pieces() says which ranges a rank holds, so saving is "write my
pieces"; loading asks model.pieces() again, on the loading strategy and world
size, and copies the overlapping slices out of the files that hold them. DDP
holds everything on every rank: there rank r writes every N-th piece, and
every rank loads everything.

Reading: torch.load(mmap=True, weights_only=True), so only the pages a rank
slices are read from disk, and nothing but tensors and plain containers is
unpickled. Each saved tensor carries a CRC32 per block of 1 MiB, checked for
the blocks a rank reads; meta.pt records each shard's size, so a truncated
file is found before it is opened. Every rank reads and checks everything it
needs before it changes anything, and all ranks agree on errors (one
all_gather_object), so a bad checkpoint raises the same clear error on every
rank and leaves the model as it was.

Crash safety: save writes into `.NAME.saving` next to `path`, and rank 0
renames it to `path` only after every file is written. An existing checkpoint
is first renamed to `.NAME.old` and deleted last; a crash between the two
renames leaves `.NAME.old`, which load then uses. A leftover `.NAME.saving`
is never read, and the next save deletes it. All ranks must see the same
filesystem (one node's disk, or a shared one).
"""
from .consolidate import consolidate
from .pretrained import load_pretrained
from .sharded import CheckpointError, load, save

__all__ = ["CheckpointError", "consolidate", "load", "load_pretrained", "save"]
