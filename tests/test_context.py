"""Context parallelism (tiny_zero.context) equals single-process torch.

Ring attention and Ulysses on a share of the sequence equal torch's attention
on the whole of it (outputs and the grads of q, k, v), causal and not, with
grouped key/value heads too. ContextParallel trains the example GPT, a
Hugging Face Llama with GQA and a non-causal encoder as torch does on one process: the outputs, the
loss of every step and every parameter after AdamW steps; with context x ddp
too. Bad input gets one clear error on every rank.

The quick tier runs one world of 2; the other worlds are in the slow tier."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from harness import check_failures, run_checks  # noqa: E402

METHODS = ("ring", "ulysses")


def attention_plan(size):
    """(is_causal, query heads, key/value heads): all heads alike and GQA, whose counts Ulysses can split."""
    cases = [(False, 2 * size, 2 * size), (True, 2 * size, 2 * size), (False, 2 * size, size), (True, 2 * size, size)]
    return [("ring", "attention_parity", ("ring", cases)),
            ("ulysses", "attention_parity", ("ulysses", cases)),
            ("refused", "ulysses_refuses", (2 * size, size // 2))]


def model_plan(kind, cp_size, heads):
    return [(f"{kind} {method} cp={cp_size}", "model_parity", (kind, method, cp_size, 3, heads)) for method in METHODS]


def errors_plan(size):
    """A length that does not split (ring cuts 2C chunks), and heads that Ulysses cannot split."""
    return [("length", "refused", ("gpt", "ring", size, 2 * size, 2 * size * 4 + size)),
            ("heads", "refused", ("gpt", "ulysses", size, size + 1, 4 * size))]


def check(results):
    check_failures(results, {"refused": "must both divide by", "length": "does not split into",
                             "heads": "must both divide by"})

def test_world2():
    check(run_checks(2, "context_checks", attention_plan(2) + model_plan("gpt", 2, 4) + model_plan("encoder", 2, 4)
                     + errors_plan(2)))


@pytest.mark.slow
def test_llama_world2(tmp_path):
    """And a checkpoint that loads back; activation checkpointing refused."""
    check(run_checks(2, "context_checks", model_plan("llama", 2, 4)
                     + [("checkpoint", "save_and_load", (str(tmp_path / "ckpt"),))]))


@pytest.mark.slow
def test_world4():
    """Context over 4 ranks, and context 2 x ddp 2 (and x zero2, x fsdp)."""
    check(run_checks(4, "context_checks", attention_plan(4) + model_plan("gpt", 4, 4) + model_plan("llama", 4, 8)
                     + model_plan("encoder", 4, 4) + model_plan("gpt", 2, 4) + model_plan("llama", 2, 4)
                     + model_plan("encoder", 2, 4) + errors_plan(4) + over_plan(), timeout=600))


def over_plan():
    """Context 2 x zero2 and x fsdp 2: the parameters, grads and state sharded over all 4 ranks."""
    return [(f"gpt {method} cp=2 x {strategy}", "model_parity", ("gpt", method, 2, 3, 4, 16, strategy))
            for strategy in ("zero2", "fsdp") for method in METHODS]


@pytest.mark.parametrize("size", [2, 4, 8])
def test_zigzag_gives_every_rank_the_same_causal_work(size):
    """docs/context.md's figure: under a causal mask each rank computes its own
    block and C-1 half blocks, (C+1)/2 blocks, where the last rank of a
    contiguous split computes C."""
    from tiny_zero.context.ring import Ring
    tokens = 4  # a rank's share: two chunks of 2
    work = []
    for me in range(size):
        ring = object.__new__(Ring)  # the ring's arithmetic, without a process group
        ring.me, ring.size = me, size
        scores = 0
        for step in range(size):
            rows, cols, _ = ring.meeting(step, True, tokens // 2)
            scores += len(range(tokens)[rows]) * len(range(tokens)[cols])
        work.append(scores)
    assert work == [(size + 1) * tokens ** 2 // 2] * size
