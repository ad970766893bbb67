"""Pretrained weights into a model, each rank reading only what it holds.

    load_pretrained(model, path)

`path` is a Hugging Face model directory as save_pretrained writes it
(model.safetensors, or model.safetensors.index.json and the shards it names,
or pytorch_model.bin), a .safetensors file, or a torch state_dict file.
`model` is a tiny_zero wrapper of any strategy and world size, built on the
meta device or not (call load_pretrained on every rank), or a plain module.

model.pieces() says which elements of which parameter this rank holds; those
are the only ones it reads. A safetensors tensor is read lazily
(safe_open(...).get_slice): for elements [lo, hi) of a flattened [rows, ...]
tensor, the rows they span, then the cut. A torch file is opened with
torch.load(mmap=True, weights_only=True), so only the pages sliced are read.
So an 8B model loads into 8 ranks with no rank holding it whole (ddp holds
everything, and reads everything).

Before anything changes, every rank checks every name and shape against the
files and reads its slices; the ranks agree on errors (one all_gather_object),
so a mismatch raises the same CheckpointError on every rank and leaves the
model as it was. A tied parameter loads from any of its names (Hugging Face
saves one). Persistent buffers load too; a buffer the model computes when it
is built (a rotary embedding's frequencies) is not in the files and is left
as it is.
"""
import json
import math
from contextlib import ExitStack
from pathlib import Path

import torch

from ..materialize import set_data, weights_loaded
from ..state_dicts import Piece
from .sharded import CheckpointError, _agree, _attempt, _some, progress


@torch.no_grad()
def load_pretrained(model, path):
    """Load the weights at `path` into `model` (a tiny_zero wrapper, on every
    rank; or a plain module). Raises CheckpointError, on every rank alike, if
    a name or shape differs."""
    path = Path(path)
    failed = f"cannot load pretrained weights from {path}"
    wrapped = hasattr(model, "load_pieces")
    module = model.module if wrapped else model
    if wrapped:  # model.shapes: every parameter's full shape, on every rank
        pieces, shapes = model.state_dicts.all_pieces(), model.shapes
    else:  # one device holds every parameter whole
        params = list(module.named_parameters())
        pieces = [Piece(name, p.shape, 0, p.numel(), p, 0, False) for name, p in params]
        shapes = {name: p.shape for name, p in params}
    shapes = {name: tuple(shape) for name, shape in shapes.items()}
    with ExitStack() as files:
        read, error = _attempt(_read_for_rank, path, module, shapes, pieces, files)
    if wrapped:
        _agree(failed, error)  # every rank has checked and read all it needs; nothing has changed yet
    elif error is not None:
        raise CheckpointError(f"{failed}: {error}")
    values, buffers = read
    if wrapped:
        model.load_pieces(lambda piece: values[piece.name, piece.lo, piece.hi])
    else:
        for piece in pieces:
            _set(piece.tensor, values[piece.name, piece.lo, piece.hi].view(piece.shape))
    for key, value in buffers.items():
        _set_buffer(module, key, value)
    weights_loaded(module)


def _read_for_rank(path, module, shapes, pieces, files):
    """Check the files against the model, then read this rank's pieces and
    the persistent buffers: ({(name, lo, hi): fp32 values}, {key: buffer})."""
    source = open_source(path, files)
    aliases = _aliases(module)
    found = _check(source, module, shapes, aliases)
    values = {(p.name, p.lo, p.hi): source.read(found[p.name], p.lo, p.hi)
              for p in progress(pieces, "loading pretrained weights")}
    buffers = {key: source.read(key, 0, math.prod(source.shape(key))).view(source.shape(key))
               for key in _persistent_buffers(module)}
    return values, buffers


def _aliases(module):
    """{parameter name: every state_dict key of that parameter}: a tied one has several."""
    name_of = {p: name for name, p in module.named_parameters()}
    aliases = {name: [] for name in name_of.values()}
    for key, value in module.state_dict(keep_vars=True).items():
        if value in name_of:
            aliases[name_of[value]].append(key)
    return aliases


def _persistent_buffers(module):
    params = set(module.parameters())
    return [key for key, value in module.state_dict(keep_vars=True).items() if value not in params]


def _check(source, module, shapes, aliases):
    """The file key each parameter loads from; raise naming every mismatch."""
    found = {name: next((key for key in keys if key in source.keys), None) for name, keys in aliases.items()}
    buffers = _persistent_buffers(module)
    expected = {key for keys in aliases.values() for key in keys} | set(buffers)
    problems = []
    missing = [name for name, key in found.items() if key is None] + [k for k in buffers if k not in source.keys]
    if missing:
        problems.append(f"{len(missing)} of this model's tensors are not in it: {_some(missing)}")
    unexpected = sorted(key for key in source.keys if key not in expected)
    if unexpected:
        problems.append(f"{len(unexpected)} of its tensors are not in this model: {_some(unexpected)}")
    want = {key: shapes[name] for name, key in found.items() if key is not None}
    want.update({key: tuple(module.get_buffer(key).shape) for key in buffers if key in source.keys})
    differ = [f"{key} {source.shape(key)} in the file, {shape} in this model"
              for key, shape in want.items() if source.shape(key) != shape]
    if differ:
        problems.append(f"shapes differ: {_some(differ)}")
    persistent = set(buffers)
    unset = [key for key, b in module.named_buffers() if b.is_meta and key not in persistent]
    if unset:
        problems.append(f"buffers {_some(unset)} are on the meta device and no checkpoint holds them (the model "
                        "computes them when it is built): build it under tiny_zero.materialize.meta_parameters(), "
                        "which leaves the buffers real")
    if problems:
        raise CheckpointError("; ".join(problems))
    return found


def _set(param, value):
    if param.is_meta:
        set_data(param, value.to(param.dtype))
    else:
        param.copy_(value)


def _set_buffer(module, key, value):
    owner, _, name = key.rpartition(".")
    owner = module.get_submodule(owner)
    buffer = owner._buffers[name]
    if buffer.is_meta:
        owner._buffers[name] = value.to(buffer.dtype)
    else:
        buffer.copy_(value)


# ---------------------------------------------------------------- the files

def open_source(path, files):
    """The tensors at `path`, opened lazily (`files`: an ExitStack that closes them)."""
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return Safetensors({key: path / file for key, file in weight_map.items()}, files)
        if (path / "model.safetensors").is_file():
            return Safetensors.single(path / "model.safetensors", files)
        if (path / "pytorch_model.bin").is_file():
            return TorchFile(path / "pytorch_model.bin")
        raise CheckpointError("the directory holds no model.safetensors, model.safetensors.index.json "
                              "or pytorch_model.bin")
    if not path.is_file():
        raise CheckpointError("it does not exist")
    if path.suffix == ".safetensors":
        return Safetensors.single(path, files)
    return TorchFile(path)


class Safetensors:
    """Tensors of one or more .safetensors files (an index's shards). A file
    is opened the first time a tensor in it is needed; reading a tensor's
    slice reads only the rows it spans."""

    def __init__(self, file_of, files):
        self.file_of, self.files, self.opened = file_of, files, {}
        self.keys = set(file_of)

    @classmethod
    def single(cls, file, files):
        return cls({key: file for key in cls._open(file, files).keys()}, files)

    @staticmethod
    def _open(file, files):
        try:
            from safetensors import safe_open  # imported only to read safetensors files
        except ImportError:
            raise CheckpointError("reading .safetensors files needs the safetensors package "
                                  "(the hf extra: pip install -e \".[hf]\")") from None
        if not file.is_file():
            raise CheckpointError(f"{file.name} is missing")
        return files.enter_context(safe_open(str(file), framework="pt"))

    def _file(self, key):
        file = self.file_of[key]
        if file not in self.opened:
            self.opened[file] = self._open(file, self.files)
        return self.opened[file]

    def shape(self, key):
        return tuple(self._file(key).get_slice(key).get_shape())

    def read(self, key, lo, hi):
        """Elements [lo, hi) of tensor `key`, flattened, in fp32 (a new tensor)."""
        shape = self.shape(key)
        if not shape or lo == hi:  # a scalar, or nothing to read
            return self._file(key).get_tensor(key).reshape(-1)[lo:hi].float()
        row = math.prod(shape[1:])  # elements per index of the first dimension
        first, end = lo // row, -(-hi // row)  # the rows that [lo, hi) spans
        rows = self._file(key).get_slice(key)[first:end]
        return rows.reshape(-1)[lo - first * row:hi - first * row].float()


class TorchFile:
    """A torch state_dict file, memory-mapped: a slice reads only its pages."""

    def __init__(self, file):
        try:
            self.tensors = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:
            reason = (str(e).strip().splitlines() or [""])[0][:160]
            raise CheckpointError(f"torch.load cannot read {file.name} ({type(e).__name__}: {reason})") from None
        if not isinstance(self.tensors, dict) or not all(torch.is_tensor(t) for t in self.tensors.values()):
            raise CheckpointError(f"{file.name} is not a state_dict (a dict of tensors)")
        self.keys = set(self.tensors)

    def shape(self, key):
        return tuple(self.tensors[key].shape)

    def read(self, key, lo, hi):
        """Elements [lo, hi) of tensor `key`, flattened, in fp32: a copy, not the mapped file."""
        return self.tensors[key].reshape(-1)[lo:hi].to(torch.float32, copy=True)
