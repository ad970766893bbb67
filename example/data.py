"""Byte-level training data from real text.

The default corpus is the Python standard library's own source: every .py
file under sysconfig's "stdlib" path (recursively, sorted by relative path,
skipping site-packages), concatenated and capped at DEFAULT_MAX_BYTES. It is
read fresh each time (nothing is cached on disk) in well under a second.

Batches are a pure function of (seed, step, split): every rank draws the same
world_size * batch_size start offsets and keeps its own rows, so ranks
0..N-1 together see exactly the batch that a single process would see with
an N times larger batch size.
"""

import os
import struct
import sysconfig
import zlib
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 8 * 1024 * 1024  # the default corpus is ~30 MB; 8 MiB is plenty


def _files_under(root: Path, suffix: str = "", skip_dirs: tuple[str, ...] = ()) -> list[Path]:
    """Files under `root` (recursively), sorted by their path relative to `root`."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip_dirs]
        found += [Path(folder, f).relative_to(root) for f in files if f.endswith(suffix)]
    return [root / rel for rel in sorted(found, key=lambda p: p.as_posix())]


def load_text(path: str | os.PathLike | None = None) -> bytes:
    """The training text as bytes.

    path=None: the standard library's .py files (see the module docstring).
    path to a file: its bytes. path to a folder: every file under it,
    recursively, sorted by relative path, concatenated; files containing a NUL
    byte are taken to be binary and skipped.
    """
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for f in _files_under(root, ".py", skip_dirs=("site-packages", "__pycache__")):
            chunks.append(f.read_bytes())
            total += len(chunks[-1])
            if total >= DEFAULT_MAX_BYTES:
                break
        text = b"".join(chunks)[:DEFAULT_MAX_BYTES]
        if not text:
            raise ValueError(f"no .py files found under the standard library folder {root}")
        return text

    p = Path(path)
    if p.is_file():
        text = p.read_bytes()
    elif p.is_dir():
        text = b"".join(b for b in (f.read_bytes() for f in _files_under(p)) if b"\0" not in b)
    else:
        raise FileNotFoundError(f"--data {path}: no such file or folder")
    if not text:
        raise ValueError(f"--data {path}: no text found (empty file, or a folder without non-binary files)")
    return text


class ByteData:
    """Text as a uint8 tensor, split into train (first part) and val (the rest)."""

    SPLITS = ("train", "val")

    def __init__(self, data: bytes, seq_len: int, val_fraction: float = 0.05):
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.seq_len = seq_len
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        n_train = int(len(tokens) * (1.0 - val_fraction))
        self.train, self.val = tokens[:n_train], tokens[n_train:]
        for split in self.SPLITS if val_fraction > 0 else ("train",):
            n = len(getattr(self, split))
            if n < seq_len + 1:
                raise ValueError(
                    f"text too short: the {split} split has {n} bytes but one sequence needs "
                    f"seq_len + 1 = {seq_len + 1} (text is {len(tokens)} bytes, val_fraction={val_fraction})"
                )

    def get_batch(self, split: str, batch_size: int, step: int, seed: int = 0, rank: int = 0,
                  world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 of shape (batch_size, seq_len), y = x shifted left by one.

        Depends only on (seed, step, split): world_size * batch_size offsets are
        drawn, and `rank` takes rows [rank * batch_size, (rank + 1) * batch_size).
        """
        if split not in self.SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        data = getattr(self, split)
        if len(data) < self.seq_len + 1:
            raise ValueError(f"the {split} split has {len(data)} bytes, fewer than seq_len + 1 = {self.seq_len + 1}")
        g = torch.Generator(device="cpu")
        # torch's CPU generator uses only 32 bits of a seed. CRC32 of a fixed-length
        # record never gives two steps (of the same seed and split) the same seed.
        g.manual_seed(zlib.crc32(struct.pack("<qqq", seed, step, self.SPLITS.index(split))))
        starts = torch.randint(0, len(data) - self.seq_len, (world_size * batch_size,), generator=g)
        starts = starts[rank * batch_size:(rank + 1) * batch_size]
        rows = data[starts[:, None] + torch.arange(self.seq_len + 1)].long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
