"""A plain state_dict from a sharded checkpoint, without torch.distributed:
`python -m tiny_zero.checkpoint consolidate PATH OUT.pt`, or, with
`--format safetensors`, a model.safetensors that transformers'
from_pretrained loads (put it next to the model's config.json)."""
import argparse
import math
import sys
from pathlib import Path

import torch

from .sharded import CheckpointError, ShardReader, _find, _read_meta, progress


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
        for p in progress(meta["params"], "consolidating"):
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
    c.add_argument("out", help="the file to write: OUT.pt, load it with module.load_state_dict(torch.load(OUT)); "
                              "or DIR/model.safetensors, next to the model's config.json, for from_pretrained(DIR)")
    c.add_argument("--format", choices=["pt", "safetensors"], default="pt",
                   help="pt: torch.save of the state_dict, every key (default); safetensors: each tensor once, "
                        "under its parameter's name (a tied weight under the name Hugging Face keeps)")
    args = parser.parse_args(argv)
    try:
        state, meta = _consolidate(Path(args.path))
    except CheckpointError as e:
        sys.exit(f"error: {e}")
    if args.format == "safetensors":
        state = write_safetensors(state, meta, args.out)
    else:
        torch.save(state, args.out)
    numel = sum(math.prod(p["shape"]) for p in meta["params"])
    print(f"{args.out}: {len(state)} tensors, {numel:,} parameters in fp32, step {meta['step']} "
          f"({meta['strategy']} on {meta['world_size']} ranks)")


def write_safetensors(state, meta, out):
    """Each tensor once: safetensors refuses two keys of one tensor. A tied
    parameter is written under its first name (the input embedding's), the
    one transformers loads and ties the others to. Returns what was written."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        sys.exit("error: --format safetensors needs the safetensors package (the hf extra: pip install -e \".[hf]\")")
    names = {p["name"] for p in meta["params"]} | set(meta["buffers"])
    unique = {key: value for key, value in state.items() if key in names}
    save_file(unique, out, metadata={"format": "pt"})  # transformers checks the format
    return unique
