"""Byte-level data: the default corpus, deterministic per-rank batches, errors."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch

from example.data import DEFAULT_MAX_BYTES, ByteData, load_text


@pytest.fixture(scope="module")
def data() -> ByteData:
    return ByteData(load_text(), seq_len=32)


def test_default_corpus_loads_and_is_deterministic():
    text = load_text()
    assert 1_000_000 < len(text) <= DEFAULT_MAX_BYTES
    assert b"def " in text and b"import " in text
    assert load_text() == text


def test_splits(data):
    n = len(data.train) + len(data.val)
    assert data.train.dtype == torch.uint8
    assert len(data.val) == n - int(n * 0.95)


def test_batch_shapes_and_shift(data):
    x, y = data.get_batch("train", 4, step=0)
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # each row is a real window of the train split: y's last byte follows x's last byte
    text = data.train.numpy().tobytes()
    for row_x, row_y in zip(x, y):
        start = text.find(bytes(row_x.tolist()) + bytes([row_y[-1].item()]))
        assert start >= 0


def test_batches_are_deterministic(data):
    a = data.get_batch("train", 4, step=7, seed=1, rank=1, world_size=2)
    b = data.get_batch("train", 4, step=7, seed=1, rank=1, world_size=2)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_batches_differ_by_step_seed_and_split(data):
    x = data.get_batch("train", 4, step=0)[0]
    assert not torch.equal(x, data.get_batch("train", 4, step=1)[0])
    assert not torch.equal(x, data.get_batch("train", 4, step=0, seed=1)[0])
    val = data.get_batch("val", 4, step=0)[0]
    assert val.shape == (4, 32) and not torch.equal(x, val)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("split", ["train", "val"])
def test_ranks_together_equal_one_big_batch(data, world_size, split):
    b = 5
    for step in (0, 3):
        full_x, full_y = data.get_batch(split, world_size * b, step, seed=2)
        parts = [data.get_batch(split, b, step, seed=2, rank=r, world_size=world_size) for r in range(world_size)]
        assert torch.equal(torch.cat([x for x, _ in parts]), full_x)
        assert torch.equal(torch.cat([y for _, y in parts]), full_y)
        assert not torch.equal(parts[0][0], parts[1][0])


def test_bad_arguments(data):
    with pytest.raises(ValueError, match="split"):
        data.get_batch("test", 2, 0)
    with pytest.raises(ValueError, match="rank"):
        data.get_batch("train", 2, 0, rank=2, world_size=2)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data .*nope.txt: no such file or folder"):
        load_text(tmp_path / "nope.txt")


def test_empty_folder_and_file(tmp_path):
    with pytest.raises(ValueError, match="no text found"):
        load_text(tmp_path)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="no text found"):
        load_text(tmp_path / "empty.txt")


def test_text_shorter_than_a_sequence(tmp_path):
    with pytest.raises(ValueError, match="too short"):
        ByteData(b"hello world", seq_len=32)
    with pytest.raises(ValueError, match="too short"):
        ByteData(b"", seq_len=4)
    with pytest.raises(ValueError, match="too short.*val"):  # train fits, the 5% val split does not
        ByteData(b"x" * 100, seq_len=32)
    assert len(ByteData(b"x" * 33, seq_len=32, val_fraction=0.0).train) == 33


def test_folder_with_two_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"second file\n" * 50)
    (tmp_path / "sub" / "a.txt").write_bytes(b"first file\n" * 50)
    (tmp_path / "image.bin").write_bytes(b"\x89PNG\0\0binary")  # skipped: contains NUL
    text = load_text(tmp_path)
    assert text == b"second file\n" * 50 + b"first file\n" * 50  # "b.txt" sorts before "sub/a.txt"
    assert load_text(str(tmp_path / "b.txt")) == b"second file\n" * 50
    x, y = ByteData(text, seq_len=16).get_batch("train", 3, step=0)
    assert x.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1])
