"""tiny_zero.measure.trace: one recorded step holds exactly the collectives that
comm counts, well-formed spans, the memory breakdown's peak, a valid Chrome
trace, and overlap computed from the spans; and recording changes nothing
that training computes. Every strategy in one spawned world of 2 ranks."""
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from harness import run_checks  # noqa: E402

from tiny_zero.measure import trace  # noqa: E402

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
RUNS = ["single_device"] + STRATEGIES


@pytest.fixture(scope="module")
def world2():
    plan = [(("recorded", n), "record", (n,)) for n in RUNS]
    plan += [(("unrecorded", n), "unrecorded", (n,)) for n in RUNS]
    return run_checks(2, "trace_checks", plan)


def recorded(world2, name):
    """[each rank's result]; single_device ran on every rank alike: rank 0's."""
    results = world2["recorded", name]
    return results[:1] if name == "single_device" else results


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_trace_holds_exactly_the_collectives_comm_counted(name, world2):
    for result in recorded(world2, name):
        mine = result["traces"][result["rank"]] if name != "single_device" else result["traces"][0]
        calls, sent = Counter(), Counter()
        for span in trace.of(mine, "comm"):
            calls[span["name"]] += 1
            sent[span["name"]] += span["args"]["bytes"]
        assert {kind: (calls[kind], sent[kind]) for kind in calls} == result["counted"]
        assert bool(calls) == (name != "single_device")


def nesting_problems(events):
    """Spans of one lane must nest: each starts after the one before ends, or ends inside it."""
    problems, open_ = [], []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while open_ and open_[-1]["ts"] + open_[-1]["dur"] <= e["ts"]:
            open_.pop()
        if open_ and e["ts"] + e["dur"] > open_[-1]["ts"] + open_[-1]["dur"]:
            problems.append(f"{e['name']} crosses the end of {open_[-1]['name']}")
        open_.append(e)
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_spans_are_well_formed(name, world2):
    traces = recorded(world2, name)[0]["traces"]
    assert [t["rank"] for t in traces] == list(range(len(traces)))
    for t in traces:
        assert all(0 <= s["start"] <= s["end"] <= t["end"] for s in t["spans"]), "a span ends before it starts"
        assert [s["name"] for s in trace.of(t, "phase")] == ["forward", "backward", "step"]
        layers = trace.of(t, "layer")
        assert any(s["name"] == "lm_head forward" for s in layers)
        assert any(s["name"] == "blocks.1.mlp.c_fc backward" for s in layers)
        collectives = {c["args"]["number"]: c for c in trace.of(t, "comm")}
        for wait in trace.of(t, "wait"):  # waited for after its launch, and complete once the wait returns
            if wait["args"]["for"] is not None:
                waited_for = collectives[wait["args"]["for"]]
                assert waited_for["start"] <= wait["start"] and waited_for["end"] <= wait["end"]
    events = [e for e in trace.chrome(traces)["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == set(range(len(traces)))
    for pid, tid in {(e["pid"], e["tid"]) for e in events}:
        lane = [e for e in events if (e["pid"], e["tid"]) == (pid, tid)]
        assert not nesting_problems(lane), (pid, tid, nesting_problems(lane)[:3])


def test_a_crossing_span_is_caught():
    a = {"name": "a", "ts": 0, "dur": 10}
    assert nesting_problems([a, {"name": "b", "ts": 2, "dur": 5}, {"name": "c", "ts": 10, "dur": 1}]) == []
    assert nesting_problems([a, {"name": "b", "ts": 5, "dur": 10}])


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_memory_curve_peak_is_the_breakdowns_peak(name, world2):
    for result in recorded(world2, name):
        mine = result["traces"][result["rank"]] if name != "single_device" else result["traces"][0]
        size, _, split = trace.peak(mine)
        assert mine["peak_exact"]
        assert size == result["peak"]
        assert split == result["breakdown"]
        assert all(sum(s.values()) <= size for _, s in mine["memory"])


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_recording_changes_no_number(name, world2):
    for with_, without in zip(recorded(world2, name), world2["unrecorded", name]):
        assert with_["losses"] == without["losses"]
        assert with_["params"].keys() == without["params"].keys()
        for key, value in with_["params"].items():
            assert torch.equal(value, without["params"][key]), key


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_chrome_json_is_a_valid_trace(name, world2, tmp_path):
    traces = recorded(world2, name)[0]["traces"]
    path = tmp_path / "trace.json"
    trace.write(path, traces, name)
    data = json.loads(path.read_text())
    assert isinstance(data["traceEvents"], list) and data["traceEvents"]
    required = {"X": {"name", "ph", "ts", "dur", "pid", "tid"}, "C": {"name", "ph", "ts", "pid", "args"},
                "M": {"name", "ph", "pid", "args"}}
    for e in data["traceEvents"]:
        assert required[e["ph"]] <= e.keys(), e
        assert all(isinstance(e[k], (int, float)) for k in ("ts", "dur", "pid", "tid") if k in e)
        if e["ph"] == "C":
            assert all(isinstance(v, int) for v in e["args"].values())
    kinds = Counter(e["ph"] for e in data["traceEvents"])
    assert kinds["X"] and kinds["C"] and kinds["M"]
    read_back, title = trace.read(path)
    assert title == name
    assert [sorted(t["spans"], key=lambda s: (s["start"], s["name"])) for t in read_back] == \
        [sorted(t["spans"], key=lambda s: (s["start"], s["name"])) for t in traces]
    assert [t["memory"] for t in read_back] == [t["memory"] for t in traces]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "zero2"])
def test_communication_overlaps_compute(name, world2):
    summary = trace.summary(recorded(world2, name)[0]["traces"])
    assert summary["hidden"] > 0


def test_overlap_is_computed_from_the_spans():
    """A collective in flight while the rank computes is hidden; while it waits, not."""
    def one_rank(comm, waits):
        spans = [{"cat": "phase", "name": "backward", "start": 0, "end": 100, "args": {}}]
        spans += [{"cat": "comm", "name": "all_reduce", "start": a, "end": b, "args": {}} for a, b in comm]
        spans += [{"cat": "wait", "name": "wait all_reduce", "start": a, "end": b, "args": {}} for a, b in waits]
        return {"rank": 0, "spans": spans, "memory": [[0, {"other": 1}]], "end": 100}
    assert trace.summary([one_rank([(10, 30)], [])])["hidden"] == 1
    assert trace.summary([one_rank([(10, 30)], [(10, 30)])])["hidden"] == 0
    assert trace.summary([one_rank([(10, 30), (20, 40)], [(30, 40)])])["hidden"] == pytest.approx(20 / 30)
    assert trace.summary([one_rank([], [])])["hidden"] is None


@pytest.mark.slow
def test_pictures_are_drawn(world2, tmp_path):
    pytest.importorskip("matplotlib")
    from tiny_zero.measure import draw
    draw.timeline(recorded(world2, "zero2")[0]["traces"], tmp_path / "timeline.png", "zero2")
    draw.memory([(n, recorded(world2, n)[0]["traces"]) for n in RUNS], tmp_path / "memory.png")
    trace.write(tmp_path / "fsdp.json", recorded(world2, "fsdp")[0]["traces"], "fsdp")
    draw.main([str(tmp_path / "fsdp.json")])  # python -m tiny_zero.measure.draw: from the JSON alone
    for png in ("timeline.png", "memory.png", "fsdp.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- --trace on the examples

def test_single_device_example_records_a_step(tmp_path, monkeypatch):
    from test_examples import TINY, losses, run_in_process
    flags = [*TINY, "--steps", "3", "--batch-size", "2"]
    plain = run_in_process("single_device", *flags)
    out = run_in_process("single_device", *flags, "--trace", str(tmp_path / "with"))
    assert losses(out) == losses(plain) and len(losses(out)) == 3
    traces, title = trace.read(tmp_path / "with" / "trace.json")
    assert len(traces) == 1 and "step 2" in title and traces[0]["peak_exact"]
    assert (tmp_path / "with" / "trace.png").is_file()
    assert "hidden" not in out and "no communication" in out

    from tiny_zero.measure import draw
    monkeypatch.setattr(draw, "pyplot", lambda: (_ for _ in ()).throw(ImportError("no matplotlib")))
    out = run_in_process("single_device", *flags, "--trace", str(tmp_path / "without"))
    assert (tmp_path / "without" / "trace.json").is_file() and not (tmp_path / "without" / "trace.png").exists()
    assert 'pip install -e ".[plot]", then python -m tiny_zero.measure.draw' in out


@pytest.mark.slow
def test_two_ranks_record_a_step_and_train_alike(tmp_path):
    from test_examples import TINY, losses, run_in_process, torchrun
    one_device = losses(run_in_process("single_device", *TINY, "--steps", "4", "--batch-size", "4"))
    out = torchrun("ddp", *TINY, "--steps", "4", "--batch-size", "2", "--trace", str(tmp_path))
    assert losses(out) == pytest.approx(one_device, rel=1e-5, abs=0)
    traces, _ = trace.read(tmp_path / "trace.json")
    assert [t["rank"] for t in traces] == [0, 1]
    assert all(trace.of(t, "comm") and trace.of(t, "layer") for t in traces)
    assert re.search(r"^ddp: .* hidden under compute; waited .* peak", out, re.MULTILINE)
