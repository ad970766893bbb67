"""example/lifecycle.py, one weight's life under zero3 and fsdp: the steady
step that docs/zero3.md and docs/fsdp.md quote is what the script prints now
(so the docs move with the code), and the trace holds each strategy's
essential moments in their order. One torchrun world of 2 ranks, both
strategies."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
# what each strategy must do to the weight, in this order, in each step
ESSENTIAL = {
    "zero3": [("forward", r"^  broadcast \d+ elements from rank 1$"),
              ("forward", r"^rank 1: before_layer done, the Linear computes: holds a view of unit_buffer"),
              ("forward", r"^rank 1: free blocks\.1: .*holds the released placeholder$"),
              ("backward", r"^grad_ready: into bucket"),
              ("backward", r"^  reduce \d+ elements to rank 0$"),
              ("backward", r"^finish bucket \d+: waited; the weight's average into model\.grads"),
              ("step", r"^AdamW steps shards\[0\]")],
    "fsdp": [("forward", r"^  all_gather \d+ elements per rank into \d+$"),
             ("forward", r"^before_layer done, the Linear computes: holds a view of unit_buffer"),
             ("forward", r"^free blocks\.1: .*holds the released placeholder$"),
             ("backward", r"^grad_ready: into bucket"),
             ("backward", r"^  reduce_scatter \d+ elements into \d+ per rank$"),
             ("backward", r"^finish bucket \d+: waited; the weight's average into model\.grads"),
             ("step", r"^AdamW steps shards\[\d+\]"),
             ("step", r"^rank 1: AdamW steps shards\[\d+\]")],
}


@pytest.fixture(scope="module")
def printed():
    """{strategy: its lines}, from one run of the script."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "example/lifecycle.py", "--strategy", "zero3", "fsdp"],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    parts = re.split(r"^(?=== )", result.stdout, flags=re.MULTILINE)
    return {part.split(":")[0][3:]: part.rstrip("\n").splitlines() for part in parts if part.startswith("== ")}


def steps(lines):
    """[step 1's lines, step 2's lines]: each from its '-- step' line on."""
    starts = [i for i, line in enumerate(lines) if line.startswith("-- step")]
    return [lines[start:end] for start, end in zip(starts, starts[1:] + [len(lines)])]


def steady(lines):
    """What the docs quote: the header, the holdings at wrap, and step 2."""
    return lines[:next(i for i, line in enumerate(lines) if line.startswith("-- step"))] + steps(lines)[1]


def events(step):
    """[(phase, what)] of a step's lines, rank 0's and rank 1's alike (their 'at' lines left out)."""
    return [(line[:8].strip(), line[9:]) for line in step[1:] if not line.startswith(" ")]


def quoted(page):
    """The ```text block of the page that quotes the script's output."""
    blocks = re.findall(r"^```text\n(.*?)^```$", (ROOT / "docs" / page).read_text(), re.MULTILINE | re.DOTALL)
    return next(block.splitlines() for block in blocks if block.startswith("== "))


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_docs_quote_what_the_script_prints(printed, strategy):
    assert quoted(f"{strategy}.md") == steady(printed[strategy])


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_each_step_holds_the_strategys_moments_in_order(printed, strategy):
    for step in steps(printed[strategy]):
        found, position = events(step), -1
        for phase, pattern in ESSENTIAL[strategy]:
            later = [i for i, (p, what) in enumerate(found) if i > position and p == phase and re.search(pattern, what)]
            assert later, f"{strategy} {step[0]}: no {phase} event {pattern!r} after event {position}"
            position = later[0]


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_the_first_step_gathers_without_prefetch_the_second_prefetches(printed, strategy):
    first, second = (events(step) for step in steps(printed[strategy]))
    assert ("forward", "gather blocks.1: start_gather now, not prefetched:") in first
    assert ("forward", "prefetch blocks.1: start_gather ahead of use:") in second
    assert ("forward", "gather blocks.1: started ahead (prefetched)") in second


def test_each_hop_names_a_line_of_that_function(printed):
    """Each 'at' hop, file:line function, points into that function's source in tiny_zero/."""
    hops = {hop for lines in printed.values() for line in lines if line.startswith(" " * 11 + "at ")
            for hop in line.strip()[3:].split(" > ")}
    for hop in hops:
        place, function = hop.split(" ")
        path, line = place.split(":")
        source = (ROOT / "tiny_zero" / path).read_text().splitlines()
        above = [text for text in source[:int(line)] if re.match(rf"\s*def {function}\(", text)]
        assert above, f"{hop}: no def {function} at or above line {line} of tiny_zero/{path}"
