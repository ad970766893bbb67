"""Sharded checkpoints: every rank writes its part; load reshards.

See the package docstring (tiny_zero/checkpoint/__init__.py) for the format.
"""
import bisect
import logging
import math
import os
import re
import shutil
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from .. import agreements, comm
from ..materialize import weights_loaded
from ..optimizer_state_dicts import param_group_differences
from ..optimizer_state_dicts import some as _some
from ..state_dicts import state_dict_names

log = logging.getLogger("tiny_zero")

FORMAT = "tiny_zero checkpoint"
SHARD_FORMAT = "tiny_zero checkpoint shard"
VERSION = 1
META = "meta.pt"
KINDS = ("param", "exp_avg", "exp_avg_sq")  # what a shard holds for each range, all fp32
BLOCK = 2**18  # elements per checksum block: 1 MiB of fp32
PROGRESS_AFTER_S = 2.0  # work that lasts longer than this shows a progress bar


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; raised on every rank alike."""


def shard_file(rank, world_size):
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def saving_dir(path):
    return path.parent / f".{path.name}.saving"


def backup_dir(path):
    return path.parent / f".{path.name}.old"


# ---------------------------------------------------------------- save

@torch.no_grad()
def save(path, model, opt, *, step=0, extra=None):
    """Write a checkpoint of `model` and its optimizer `opt` to directory
    `path` (replacing one that is there). Call it on every rank. `extra`: plain
    Python values and tensors (it is read back with weights_only=True)."""
    path = Path(path)
    comm.where = "saving a checkpoint"
    failed = f"saving checkpoint {path} failed"
    saving = saving_dir(path)
    agreements.check_agreements()  # ranks that disagree on a step (their replicas apart) write nothing
    _agree(failed, _attempt(_start_saving, path, saving)[1] if model.rank == 0 else None)
    info, error = _attempt(_write_shard, saving, model, opt)
    infos = _agree(failed, error, info)  # every rank's file is complete after this
    error = None
    if model.rank == 0:
        _, error = _attempt(_publish, saving, path, model, opt, infos, step, extra)
    _agree(failed, error)


def _start_saving(path, saving):
    if path.exists() and not (path.is_dir() and (not any(path.iterdir()) or (path / META).is_file())):
        raise CheckpointError(f"{path} exists and is not a tiny_zero checkpoint: not replacing it")
    shutil.rmtree(saving, ignore_errors=True)  # what a crashed save left
    saving.mkdir(parents=True)


def _write_shard(saving, model, opt):
    """This rank's pieces, the loss scaler's state; returns what meta.pt needs."""
    pieces = model.pieces()
    layout = {p.name: (tuple(p.shape), str(p.tensor.dtype).removeprefix("torch.")) for p in pieces}
    pieces = model.pieces_to_save()  # each element by one rank only
    shard = {"format": SHARD_FORMAT, "version": VERSION, "rank": model.rank, "world_size": model.world_size,
             **{kind: {} for kind in KINDS}, "step": {}, "checksums": {}}
    for piece in progress(pieces, "saving checkpoint"):
        key, n = (piece.name, piece.lo, piece.hi), piece.hi - piece.lo
        exp_avg, exp_avg_sq, step = opt.piece_state(piece)  # no AdamW state before the first step
        values = {"param": piece.tensor[piece.offset:piece.offset + n], "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        for kind in KINDS:
            if values[kind] is not None:  # a copy of exactly n elements: torch.save writes a view's whole storage
                shard[kind][key] = values[kind].detach().to("cpu", torch.float32, copy=True)
            else:
                shard[kind][key] = torch.zeros(n)
            shard["checksums"][(kind, *key)] = [_crc(block) for block in shard[kind][key].split(BLOCK)]
        shard["step"][key] = step
    scaler = getattr(model, "loss_scaler", None)
    shard["loss_scaler"] = scaler.state_dict() if scaler is not None else None
    shard["skipped_steps"] = getattr(opt, "skipped_steps", None)
    file = saving / shard_file(model.rank, model.world_size)
    _write(shard, file)
    return {"file": file.name, "size": file.stat().st_size, "ranges": list(shard["step"]), "layout": layout}


def _meta(model, opt, infos, step, extra):
    return {
        "format": FORMAT, "version": VERSION,
        "strategy": type(model).__name__, "world_size": model.world_size,
        "params": _params(model.module, infos),
        "param_groups": opt.named_param_groups(),  # the optimizer's settings, its parameters by name
        "state_dict": state_dict_names(model.module),
        "buffers": _buffers(model.module),
        "files": {i["file"]: {"size": i["size"], "ranges": i["ranges"]} for i in infos},
        "step": step, "extra": {} if extra is None else extra,
    }


def _params(module, infos):
    layout = {}
    for info in infos:
        layout.update(info["layout"])
    params = []
    for name, p in module.named_parameters():  # tied parameters appear once
        shape, dtype = layout.get(name, (tuple(p.shape), str(p.dtype).removeprefix("torch.")))
        params.append({"name": name, "shape": shape, "dtype": dtype})
    return params


def _buffers(module):
    params = set(module.parameters())
    return {key: value.detach().cpu().clone() for key, value in module.state_dict(keep_vars=True).items()
            if value not in params}


def _write(obj, file):
    with open(file, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename that publishes it


def _publish(saving, path, model, opt, infos, step, extra):
    """meta.pt last, then the directory into place."""
    _write(_meta(model, opt, infos, step, extra), saving / META)
    try:  # what load will do, so that an `extra` it cannot read fails now, not at resume time
        torch.load(saving / META, weights_only=True)
    except Exception as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f"a {found[1]}" if found else f"{type(e).__name__}: {str(e)[:120]}"
        raise CheckpointError(f"extra holds something that torch.load(weights_only=True) cannot read back "
                              f"({what}): use plain Python values and tensors") from None
    backup = backup_dir(path)
    if path.exists():
        shutil.rmtree(backup, ignore_errors=True)  # a backup older than path
        os.replace(path, backup)
    # else: a backup, if any, is the last complete checkpoint; it goes only once the new one is in place
    os.replace(saving, path)
    shutil.rmtree(backup, ignore_errors=True)


# ---------------------------------------------------------------- load

@torch.no_grad()
def load(path, model, opt, optimizer_states=True):
    """Restore parameters, optimizer state and settings (opt.param_groups'
    lr and the rest, as torch's opt.load_state_dict) and loss scale saved by
    save(), whatever strategy and world size saved them; optimizer_states
    False: the parameters (their fp32 values) and buffers only. Call it on
    every rank. Returns {"step": ..., "extra": ...} as given to save()."""
    path = Path(path)
    comm.where = "loading a checkpoint"
    failed = f"cannot load checkpoint {path}"
    pieces = model.pieces()
    shapes = {name: tuple(shape) for name, shape in model.shapes.items()}  # full shapes, in model order
    names = list(shapes)
    groups = opt.named_param_groups() if optimizer_states else None
    read, error = _attempt(_read_for_rank, path, names, shapes, groups, pieces, model.rank)
    # every rank has read and checked all it needs, the same checkpoint; nothing has changed yet
    read_by = _agree(failed, error, payload=None if error else (str(path), read[-1]))
    if len({crc for _, crc in read_by}) > 1:
        raise CheckpointError(f"{failed}: the ranks read different checkpoints (" + "; ".join(
            f"rank {rank}: {where}" for rank, (where, _) in enumerate(read_by)) + "): load the same on every rank")
    meta, parts, scaler_state, skipped_steps, _ = read

    part_of = {(p.name, p.lo, p.hi): part for p, part in zip(pieces, parts)}
    model.load_pieces(lambda piece: part_of[piece.name, piece.lo, piece.hi][0]["param"])
    if optimizer_states:
        load_optimizer_states(path, model, opt, pieces, part_of, meta, scaler_state, skipped_steps)
    for key, value in meta["buffers"].items():
        model.module.get_buffer(key).copy_(value)
    weights_loaded(model.module)  # a model built on meta without an init may now run
    return {"step": meta["step"], "extra": meta["extra"]}


def load_optimizer_states(path, model, opt, pieces, part_of, meta, scaler_state, skipped_steps):
    """load()'s optimizer part: moments and step counts, the loss scale, the param groups' settings."""
    stepped = {id(s) for s in model.shards}
    for piece in pieces:
        if id(piece.tensor) in stepped:  # a trainable parameter's piece: its optimizer state too
            values, step = part_of[piece.name, piece.lo, piece.hi]
            opt.load_piece_state(piece, values["exp_avg"], values["exp_avg_sq"], step)
    scaler = getattr(model, "loss_scaler", None)
    if scaler is not None and scaler_state is not None:
        scaler.load_state_dict(scaler_state)
    if skipped_steps is not None and hasattr(opt, "skipped_steps"):
        opt.skipped_steps = skipped_steps
    if "param_groups" in meta:  # checked in _read_for_rank
        opt.load_param_groups(meta["param_groups"])
    else:
        log.warning("%s was saved without the optimizer's param groups (by an older tiny_zero): "
                    "their settings (lr, ...) stay as they are", path)


def _read_for_rank(path, names, shapes, groups, pieces, rank):
    directory = _find(path)
    meta = _read_meta(directory)
    _check_same_model(meta, names, shapes)
    if groups is not None:  # the optimizer's state loads too
        _check_same_groups(meta, groups)
    shards = ShardReader(directory, meta)
    parts = [shards.read(p.name, p.lo, p.hi) for p in progress(pieces, "loading checkpoint")]
    # the loss scaler's state is the same in every shard: one this rank has opened, or any
    shard = shards.open(next(iter(shards.opened), sorted(meta["files"])[rank % len(meta["files"])]))
    return meta, parts, shard.get("loss_scaler"), shard.get("skipped_steps"), zlib.crc32((directory / META).read_bytes())


def _find(path):
    if path.exists():
        return path
    backup = backup_dir(path)
    if (backup / META).is_file():
        log.warning("%s is missing but %s is complete (a save was interrupted): loading that", path, backup)
        return backup
    raise CheckpointError("it does not exist")


def _read_meta(directory):
    file = directory / META
    if not directory.is_dir():
        raise CheckpointError("not a tiny_zero checkpoint: it is a file, not a directory")
    if not file.is_file():
        raise CheckpointError(f"not a tiny_zero checkpoint: it has no {META}")
    meta = _torch_load(file, mmap=False)  # small; and `extra` must outlive the file
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{META} is not a tiny_zero checkpoint's metadata")
    if meta["version"] > VERSION:
        raise CheckpointError(f"{META} has format version {meta['version']}; this tiny_zero reads "
                              f"up to {VERSION}: update tiny_zero")
    _check_complete(meta)
    return meta


def _check_complete(meta):
    """The files' ranges of each parameter cover it exactly once."""
    ranges = {p["name"]: [] for p in meta["params"]}
    for file, info in meta["files"].items():
        for name, lo, hi in info["ranges"]:
            ranges.setdefault(name, []).append((lo, hi))
    for p in meta["params"]:
        end = 0
        for lo, hi in sorted(ranges[p["name"]]):
            if lo != end:
                raise CheckpointError(f"{META} is damaged: elements {min(lo, end)}..{max(lo, end)} of "
                                      f"{p['name']} are in {'no' if lo > end else 'two'} shard files")
            end = hi
        if end != math.prod(p["shape"]):
            raise CheckpointError(f"{META} is damaged: {p['name']} {tuple(p['shape'])} is saved "
                                  f"up to element {end}")


def _check_same_model(meta, names, shapes):
    """Names and shapes: those of the model being loaded (shapes of every
    parameter that has elements, gathered from every rank's pieces)."""
    saved = {p["name"]: tuple(p["shape"]) for p in meta["params"]}
    problems = []
    unknown = [name for name in saved if name not in names]
    if unknown:
        problems.append(f"parameters not in this model: {_some(unknown)}")
    missing = [name for name in names if name not in saved]
    if missing:
        problems.append(f"parameters of this model not in the checkpoint: {_some(missing)}")
    differ = [f"{name} {saved[name]} in the checkpoint, {shape} in this model" for name, shape in shapes.items()
              if name in saved and saved[name] != shape]
    if differ:
        problems.append(f"shapes differ: {_some(differ)}")
    if problems:
        raise CheckpointError(f"it is a checkpoint of another model ({meta['strategy']}): "
                              + "; ".join(problems))


def _check_same_groups(meta, groups):
    """The optimizer's param groups hold the parameters they held when saved."""
    problem = param_group_differences(meta.get("param_groups", groups), groups)
    if problem:
        raise CheckpointError(f"the optimizer's param groups differ from the checkpoint's: {problem}")


def progress(items, what):
    """`items`, with a progress bar on stderr on rank 0 once the work has
    lasted PROGRESS_AFTER_S: a large model takes a while to read or write."""
    quiet = dist.is_initialized() and dist.get_rank() != 0
    return tqdm(items, desc=what, unit=" tensors", disable=quiet, delay=PROGRESS_AFTER_S, leave=False)


class ShardReader:
    """Slices of parameters out of the shard files. A file is opened (mapped)
    the first time a slice needs it; the checksum blocks a slice touches are
    checked once."""

    def __init__(self, directory, meta):
        self.directory, self.meta = directory, meta
        self.where = {}  # parameter name -> [(lo, hi, file)], in order (the ranges do not overlap)
        for file, info in meta["files"].items():
            for name, lo, hi in info["ranges"]:
                self.where.setdefault(name, []).append((lo, hi, file))
        for ranges in self.where.values():
            ranges.sort()
        self.ends = {name: [hi for _, hi, _ in ranges] for name, ranges in self.where.items()}
        self.opened = {}
        self.checked = set()

    def open(self, file):
        if file not in self.opened:
            self.opened[file] = _open_shard(self.directory / file, self.meta["files"][file]["size"])
        return self.opened[file]

    def read(self, name, lo, hi, kinds=KINDS):
        """{kind: fp32 tensor of elements [lo, hi) of `name`}, and the step
        count saved with them (the largest, if they came from several ranges)."""
        out = {kind: torch.empty(hi - lo) for kind in kinds}
        step = 0.0
        ranges = self.where.get(name, [])
        i = bisect.bisect_right(self.ends.get(name, []), lo)  # the first saved range that ends after lo
        while i < len(ranges) and ranges[i][0] < hi:  # (a row of a split weight is one range: there are many)
            saved_lo, saved_hi, file = ranges[i]
            i += 1
            a, b = max(lo, saved_lo), min(hi, saved_hi)
            shard, key = self.open(file), (name, saved_lo, saved_hi)
            for kind in kinds:
                saved = shard[kind].get(key)
                if saved is None or saved.numel() != saved_hi - saved_lo:
                    raise CheckpointError(f"{file} does not hold {kind} of {name}[{saved_lo}:{saved_hi}] "
                                          f"as {META} says it does")
                self._check_blocks(file, shard, kind, key, a - saved_lo, b - saved_lo)
                out[kind][a - lo:b - lo] = saved[a - saved_lo:b - saved_lo]
            step = max(step, shard["step"][key])
        return out, step

    def _check_blocks(self, file, shard, kind, key, a, b):
        saved, crcs = shard[kind][key], shard["checksums"][(kind, *key)]
        for block in range(a // BLOCK, (b - 1) // BLOCK + 1):
            if (file, kind, key, block) not in self.checked:
                if _crc(saved[block * BLOCK:(block + 1) * BLOCK]) != crcs[block]:
                    name, lo, hi = key
                    raise CheckpointError(f"{file} is corrupted: {kind} of {name}[{lo}:{hi}] "
                                          "fails its checksum")
                self.checked.add((file, kind, key, block))


def _open_shard(file, size):
    if not file.is_file():
        raise CheckpointError(f"{file.name} is missing")
    actual = file.stat().st_size
    if actual != size:
        what = "truncated" if actual < size else "damaged"
        raise CheckpointError(f"{file.name} is {what}: {actual} bytes, {size} were written")
    shard = _torch_load(file)
    if not isinstance(shard, dict) or shard.get("format") != SHARD_FORMAT:
        raise CheckpointError(f"{file.name} is not a tiny_zero checkpoint shard")
    return shard


def _torch_load(file, mmap=True):
    try:
        with open(file, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                raise CheckpointError(f"{file.name} is corrupted: it does not begin as "
                                      "torch.save's zip files do")
        return torch.load(file, map_location="cpu", mmap=mmap, weights_only=True)
    except OSError as e:
        raise CheckpointError(f"{file.name} cannot be read: {e.strerror or e}") from None
    except CheckpointError:
        raise
    except Exception as e:  # whatever the zip reader or the unpickler says, in one line
        reason = (str(e).strip().splitlines() or [""])[0][:160]
        raise CheckpointError(f"{file.name} is corrupted or truncated: torch.load cannot read it "
                              f"({type(e).__name__}: {reason})") from None


def _crc(tensor):
    return zlib.crc32(tensor.contiguous().numpy())


# ------------------------------------------------- agreeing across ranks

def _attempt(fn, *args):
    """(fn's result, None), or (None, what went wrong in one line)."""
    try:
        return fn(*args), None
    except CheckpointError as e:
        return None, str(e)
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def _agree(context, error, payload=None):
    """Collective: every rank's (error, payload). If any rank has an error,
    every rank raises all of them, so no rank goes on to wait for the others
    in a collective they will never reach. Returns the payloads."""
    gathered = comm.all_gather_object((error, payload))
    ranks_of = {}
    for rank, (e, _) in enumerate(gathered):
        if e is not None:
            ranks_of.setdefault(e, []).append(rank)
    if ranks_of:
        if len(ranks_of) == 1 and len(next(iter(ranks_of.values()))) == len(gathered):
            raise CheckpointError(f"{context}: {next(iter(ranks_of))}")  # the same on every rank
        raise CheckpointError(f"{context}: " + "; ".join(
            f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {e}" for e, r in ranks_of.items()))
    return [p for _, p in gathered]
