"""A plain state_dict from a sharded checkpoint, without torch.distributed:
`python -m tiny_zero.checkpoint consolidate PATH OUT.pt`."""
import argparse
import math
import sys
from pathlib import Path

import torch

from .sharded import CheckpointError, ShardReader, _find, _read_meta


def consolidate(path):
    """The full fp32 state_dict of the unwrapped module (keys as its
    state_dict(), tied names included), from a checkpoint; no torch.distributed."""
    return _consolidate(Path(path))[0]


def _consolidate(path):
    try:
        directory = _find(path)
        meta = _read_meta(directory)
        shards = ShardReader(directory, meta)
        full = {}
        for p in meta["params"]:
            values, _ = shards.read(p["name"], 0, math.prod(p["shape"]), kinds=("param",))
            full[p["name"]] = values["param"].view(p["shape"])
    except CheckpointError as e:
        raise CheckpointError(f"cannot consolidate checkpoint {path}: {e}") from None
    state = {key: full[name] if name is not None else meta["buffers"][key] for key, name in meta["state_dict"]}
    return state, meta


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tiny_zero.checkpoint",
                                     description="Tools for tiny_zero's sharded checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("consolidate", help="write a plain fp32 state_dict of the unwrapped model")
    c.add_argument("path", help="a checkpoint directory written by tiny_zero.checkpoint.save")
    c.add_argument("out", help="the .pt file to write; load it with module.load_state_dict(torch.load(OUT))")
    args = parser.parse_args(argv)
    try:
        state, meta = _consolidate(Path(args.path))
    except CheckpointError as e:
        sys.exit(f"error: {e}")
    torch.save(state, args.out)
    numel = sum(math.prod(p["shape"]) for p in meta["params"])
    print(f"{args.out}: {len(state)} tensors, {numel:,} parameters in fp32, step {meta['step']} "
          f"({meta['strategy']} on {meta['world_size']} ranks)")
