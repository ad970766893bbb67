"""Context parallelism (tiny_zero.context): ring attention and Ulysses on a
share of the sequence equal torch's attention on the whole of it, causal and
not, with grouped key/value heads too. The quick tier runs one world of 2;
the world of 4 is in the slow tier."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from harness import run_checks  # noqa: E402



def attention_plan(size):
    """(is_causal, query heads, key/value heads): all heads alike and GQA, whose counts Ulysses can split."""
    cases = [(False, 2 * size, 2 * size), (True, 2 * size, 2 * size), (False, 2 * size, size), (True, 2 * size, size)]
    return [("ring", "attention_parity", ("ring", cases)),
            ("ulysses", "attention_parity", ("ulysses", cases)),
            ("refused", "ulysses_refuses", (2 * size, size // 2))]


def check_world(results, size):
    for method in ("ring", "ulysses"):
        for rank, failures in enumerate(results[method]):
            assert not failures, f"rank {rank} of {size}: {failures}"
    for message in results["refused"]:
        assert "must both divide by" in message, message


def test_world2():
    check_world(run_checks(2, "context_checks", attention_plan(2)), 2)


@pytest.mark.slow
def test_world4():
    check_world(run_checks(4, "context_checks", attention_plan(4)), 4)
