"""One training step, recorded on every rank: what each rank computes, which
collectives are in flight, where a rank waits, and the live tensor bytes.

    recorder = Recorder(model, opt, memory)   # memory: the TensorMemory counting now, or None
    recorder.start()
    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
    traces = gather(recorder.stop())          # every rank's record, on every rank
    write(path, traces)                       # Chrome/Perfetto JSON: ui.perfetto.dev opens it
    summary(traces)                           # overlap, waiting, peak: computed from the spans

A rank's record (a dict of plain lists, times in microseconds from the start):

  spans   {"cat", "name", "start", "end", "args"}, in four kinds:
    phase   forward; backward; step (from the end of backward through
            clipping and the optimizer step)
    layer   each layer's forward and backward callback, named by module path
            ("blocks.3.attn.c_proj backward"): the strategy's gather, wait and
            free around the math count as part of it
    wait    where the rank blocked in comm.Pending.wait(), and on what: a
            collective ("for": its number) or agreements.agree's side channel
    comm    each collective tiny_zero.comm counts, from launch to completion,
            with kind, bytes, elements, where it was launched (comm.where)
            and its number in the step
  memory  [time, {category: bytes}] after every allocation and free; the
          categories are TensorMemory's breakdown (memory.py)

How, without tracing code in the strategies: the layers' callbacks are wrapped
on each layer instance for the recorded step only; comm.py tells the recorder
of each launch and wait (comm.recorder); module and optimizer hooks mark the
phases; TensorMemory tells it of each allocation and free (its listeners).
Nothing the step computes changes; the step takes a little longer (the
wrappers, a time stamp per allocation, the memory split below).

When a collective completes. On gloo (CPU) a collective runs on gloo's own
threads; its future is completed there, before Work.wait() can return, and a
callback on that future takes the time. That callback needs Python's lock:
sys.setswitchinterval is lowered while recording (SWITCH_INTERVAL, from 5 ms)
so that it gets it soon while the main thread runs Python (torch lets go of
the lock inside its ops). The wait's end is the completion when it comes
first. On CUDA every time is a CUDA event, read after the step: a layer's
span is when its kernels ran on the stream, a collective ends when an event
placed behind it completes (recorded in its future's callback, on a stream
that waits for the collective), and a wait is how long the compute stream
stood still. See docs/overlap.md.

Memory split. Sorting every live storage into its category costs ~0.5 ms on
a small CPU: done at every allocation it would double the step and distort
the timeline. So the total is exact at every change, and the split is taken
exactly at the start and end, at each phase's end, at every moment that may
be the peak (a new high, at or above the highest total counted so far, that
a free follows: after warm-up a step's peak repeats, so its split is exact;
`peak_exact` says so), and at layer ends as far as SPLIT_BUDGET allows.
Between those moments a storage counts in the category it has at the next
one while it lives (else the last; a temporary never sorted counts as other).
"""
import gc
import json
import sys
import threading
import time
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist

from .. import comm
from ..hooked import HookedLayer
from ..module import CallbackLayer
from .memory import CATEGORIES, TensorMemory, held_tensors

SWITCH_INTERVAL = 1e-4  # seconds: how soon gloo's thread gets Python's lock to note a completion
SPLIT_BUDGET = 0.1  # the share of the main thread's time that taking the memory split at layer ends may use


class CpuClock:
    def __init__(self):
        self.origin = time.perf_counter()

    def stamp(self):
        return time.perf_counter()

    def micros(self, stamp):
        return (stamp - self.origin) * 1e6


class CudaClock:
    """Times on the GPU: events recorded on the current stream, read after the step."""

    def __init__(self):
        torch.cuda.synchronize()
        self.origin = self.stamp()

    def stamp(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def micros(self, stamp):
        return self.origin.elapsed_time(stamp) * 1e3


class Recorder:
    def __init__(self, model, optimizer, memory=None):
        """model: a tiny_zero wrapper or a plain module of tiny_zero layers;
        memory: the TensorMemory counting now (attached to model and
        optimizer), or None to count the recorded step with one of its own."""
        self.model, self.optimizer, self.memory = model, optimizer, memory
        self.device = getattr(model, "device", None) or next(model.parameters()).device
        self.rank, self.world_size = getattr(model, "rank", 0), getattr(model, "world_size", 1)

    # ------------------------------------------------------------ start, stop

    def start(self):
        if self.world_size > 1:  # the ranks start the step together
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.clock = CudaClock() if self.device.type == "cuda" else CpuClock()
        self.spans, self.collectives = [], []
        self.forward_start = self.backward_start = self.step_start = None
        self.own_memory = self.memory is None
        if self.own_memory:
            self.memory = TensorMemory(self.device)
            self.memory.__enter__()
            self.memory.track(held_tensors(self.model, self.optimizer))
            self.memory.attach(self.model, self.optimizer)
        self._watch_memory()
        self._wrap_layers()
        self.hooks = [self.model.register_forward_pre_hook(self._forward_begins),
                      self.model.register_forward_hook(self._forward_ends),
                      self.optimizer.register_step_post_hook(self._step_ends)]
        self.switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)
        comm.recorder = self

    def stop(self):
        """This rank's record (see the module docstring)."""
        end = self.stamp()
        self._classify()
        comm.recorder = None
        sys.setswitchinterval(self.switch_interval)
        for hook in self.hooks:
            hook.remove()
        for layer in self.wrapped:
            del layer.__dict__["forward_callback"], layer.__dict__["backward_callback"]
        for hook in self.layer_hooks:
            hook.remove()
        self.memory.listeners.remove(self._changing)
        if self.own_memory:
            self.memory.__exit__(None, None, None)
            self.memory = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        micros = self.clock.micros
        spans = [{"cat": cat, "name": name, "start": micros(start), "end": micros(stop), "args": args}
                 for cat, name, start, stop, args in self.spans]
        for c in self.collectives:  # complete when its future said so, or its wait returned, if first
            seen = [micros(c[key]) for key in ("done", "seen") if c[key] is not None] or [micros(end)]
            spans.append({"cat": c["cat"], "name": c["name"], "start": micros(c["start"]), "end": min(seen),
                          "args": c["args"]})
        curve = [[micros(t), split] for t, split in self._memory_curve(self.clock.origin)]
        totals = [sum(split.values()) for _, split in curve]
        exact = {point for point, _ in self.points}
        return {"rank": self.rank, "clock": self.device.type, "end": micros(end),
                "spans": sorted(spans, key=lambda s: (s["start"], -s["end"])), "memory": curve,
                "peak_exact": totals.index(max(totals)) in exact}

    def stamp(self):
        return self.clock.stamp()

    # ------------------------------------------------------------ comm.py tells of these

    def collective(self, pending, tensor, launched):
        """A collective just launched (at stamp `launched`): its span ends
        when its future completes."""
        index = len(self.collectives)
        pending.span = weakref.ref(self), index  # no reference back to the model from what the strategy holds
        self.collectives.append({"cat": "comm", "name": pending.kind, "start": launched, "done": None, "seen": None,
                                 "args": {"bytes": tensor.numel() * tensor.element_size(),
                                          "elements": tensor.numel(), "where": pending.where, "number": index}})
        try:
            future = pending.work.get_future()
        except (RuntimeError, NotImplementedError, AttributeError):  # a backend without futures: its wait tells
            return
        future.add_done_callback(lambda _: self._completed(index))  # holds no tensor: memory stays as it is

    def _completed(self, index):
        if comm.recorder is self:  # not after stop: the clock is gone
            self.collectives[index]["done"] = self.stamp()

    def waited(self, pending, started):
        ended = self.stamp()
        recorder, index = pending.span or (lambda: None, None)
        if recorder() is not self:  # launched before the recording began, or a side-channel agreement
            index = None
        else:
            self.collectives[index]["seen"] = ended  # its completion, if the future said nothing before
        self.spans.append(("wait", f"wait {pending.kind}", started, ended,  # "for": the collective's number
                           {"launched in": pending.where, "waited in": comm.where, "for": index}))

    # ------------------------------------------------------------ compute: layers and phases

    def _wrap_layers(self):
        root = getattr(self.model, "module", self.model)  # a wrapper's module, or the model itself
        self.wrapped, self.layer_hooks = [], []
        for path, layer in root.named_modules():
            if isinstance(layer, CallbackLayer):
                self.wrapped.append(layer)
                layer.__dict__["forward_callback"] = self._timed(layer.forward_callback, f"{path} forward")
                layer.__dict__["backward_callback"] = self._timed(layer.backward_callback, f"{path} backward")
        for layer in getattr(self.model, "strategy_layers", ()):
            if isinstance(layer, HookedLayer):  # a module reached through hooks: its forward, gather and free inside
                self._time_forward(layer.module, f"{layer.path} forward")

    def _time_forward(self, module, name):
        starts = []
        self.layer_hooks += [module.register_forward_pre_hook(lambda *_: starts.append(self.stamp()), prepend=True),
                             module.register_forward_hook(lambda *_: self._span(name, starts.pop()))]

    def _span(self, name, start):
        self.spans.append(("layer", name, start, self.stamp(), {}))
        self._classify(optional=True)

    def _timed(self, callback, name):
        def timed(ctx, x):
            start = self.stamp()
            try:
                return callback(ctx, x)
            finally:
                self.spans.append(("layer", name, start, self.stamp(), {}))
                self._classify(optional=True)
        return timed

    def _phase(self, name, start):
        self.spans.append(("phase", name, start, self.stamp(), {}))
        self._classify()

    def _forward_begins(self, module, args):
        self.forward_start = self.stamp()

    def _forward_ends(self, module, args, output):
        self._phase("forward", self.forward_start)
        leaves = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        needs_grad = [t for t in leaves if t.requires_grad]
        if needs_grad:
            needs_grad[0].register_hook(self._backward_begins)

    def _backward_begins(self, grad):
        self.backward_start = self.stamp()
        engine = torch.autograd.Variable._execution_engine
        # queued from a queued callback, so it runs after the wrapper's own
        # end-of-backward callback (whose waits belong to the backward)
        engine.queue_callback(lambda: engine.queue_callback(self._backward_ends))

    def _backward_ends(self):
        self._phase("backward", self.backward_start)
        self.step_start = self.stamp()

    def _step_ends(self, optimizer, args, kwargs):
        if self.step_start is not None:
            self._phase("step", self.step_start)

    # ------------------------------------------------------------ memory

    def _watch_memory(self):
        self.serial_of = {}  # id(storage) -> a number for its lifetime (ids are reused)
        self.initial = {}  # serial -> bytes, of the storages alive at the start
        for key, size in self.memory.categories()[1].items():
            self.serial_of[key] = len(self.serial_of)
            self.initial[self.serial_of[key]] = size
        self.serials = len(self.serial_of)
        self.changes = []  # (stamp, serial, delta): every allocation and free
        self.points = []  # (number of changes before, {serial: category}): where the split was taken
        self.highest = self.memory.current
        self.classifying, self.next_optional = False, 0.0
        self.lock = threading.RLock()  # a split is taken of one state: another thread's change waits for it
        self._classify()
        self.memory.listeners.append(self._changing)

    def _changing(self, key, delta):
        """TensorMemory: a storage is about to be allocated (delta > 0) or freed
        (by this thread, or by gloo's when it lets go of a tensor)."""
        with self.lock:
            self._record_change(key, delta)

    def _record_change(self, key, delta):
        if not delta:  # an empty storage (BatchNorm's statistics in training on the CPU): nothing to draw
            return
        memory = self.memory
        if memory.current > self.highest:
            self.highest = memory.current
            if delta <= 0 and memory.current >= memory.peak:  # a high that a free follows: maybe the peak
                self._classify()
        if delta > 0:
            self.serial_of[key] = serial = self.serials
            self.serials += 1
        else:
            serial = self.serial_of.pop(key)
        self.changes.append((self.stamp(), serial, delta))

    def _classify(self, optional=False):
        """Take the split of the storages alive now; optional: only if SPLIT_BUDGET allows."""
        if self.classifying or self.points and self.points[-1][0] == len(self.changes):
            return
        began = time.thread_time()
        if optional and began < self.next_optional:
            return
        collecting = gc.isenabled()
        self.classifying = True  # what it allocates itself does not classify again
        gc.disable()  # nor may the collector free storages halfway through
        try:
            with self.lock:  # another thread's change (gloo's, freeing) waits until the split is kept
                point = len(self.changes)
                categories = self.memory.categories()[0]
                if len(self.changes) == point:  # else this thread allocated or freed meanwhile: no one state's split
                    self.points.append((point, {self.serial_of[key]: c for key, c in categories.items()}))
        finally:
            self.classifying = False
            if collecting:
                gc.enable()
        ended = time.thread_time()
        self.next_optional = ended + (ended - began) / SPLIT_BUDGET

    def _memory_curve(self, origin):
        """[(stamp, {category: bytes})]: the state from each change on. A
        storage counts in its category at the next point where the split was
        taken while it lived, else at the last one, else as `other`."""
        marks = defaultdict(list)  # serial -> [(point, category)], in order
        for point, categories in self.points:
            for serial, category in categories.items():
                marks[serial].append((point, category))
        cursor = defaultdict(int)

        def category(serial, state):
            mine = marks.get(serial)
            if not mine:
                return "other"
            i = cursor[serial]
            while i < len(mine) - 1 and mine[i][0] < state:
                i += 1
            cursor[serial] = i
            return mine[i][1]

        live, curve = dict(self.initial), []
        for state in range(len(self.changes) + 1):
            if state == 0:
                stamp = origin
            else:
                stamp, serial, delta = self.changes[state - 1]
                if delta > 0:
                    live[serial] = delta
                else:
                    del live[serial]
            split = dict.fromkeys(CATEGORIES, 0)
            for serial, size in live.items():
                split[category(serial, state)] += size
            curve.append((stamp, split))
        return curve


def gather(trace):
    """Every rank's record, in rank order, on every rank (plain torch.distributed:
    not counted in comm.stats)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [trace]
    traces = [None] * dist.get_world_size()
    dist.all_gather_object(traces, trace)
    return traces


# ---------------------------------------------------------------- Chrome/Perfetto JSON

COMPUTE_LANE = 0  # thread id of the compute lane; the comm lanes follow
RANK_KEYS = ("clock", "end", "peak_exact")  # what a rank's record holds besides spans and memory


def comm_lanes(spans):
    """Collectives may overlap: each goes on the first comm lane free at its
    launch, so that spans on one lane never overlap. -> [lane index per span]."""
    ends, lanes = [], []
    for span in spans:
        lane = next((i for i, end in enumerate(ends) if end <= span["start"]), len(ends))
        if lane == len(ends):
            ends.append(0)
        ends[lane] = span["end"]
        lanes.append(lane)
    return lanes


def chrome(traces, title=""):
    """The traces as a Chrome trace: one process per rank, a compute lane
    (phases, layers, waits nested) and comm lanes, and a memory counter."""
    events = []
    for trace in traces:
        pid = trace["rank"]
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": COMPUTE_LANE, "args": {"name": "compute"}})
        comms = [s for s in trace["spans"] if s["cat"] == "comm"]
        lanes = comm_lanes(comms)
        for lane in range(max(lanes, default=-1) + 1):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1 + lane,
                           "args": {"name": "comm" if lane == 0 else f"comm {lane + 1}"}})
        computes = [s for s in trace["spans"] if s["cat"] != "comm"]
        for span, tid in [(s, COMPUTE_LANE) for s in computes] + [(s, 1 + lane) for s, lane in zip(comms, lanes)]:
            events.append({"ph": "X", "name": span["name"], "cat": span["cat"], "pid": pid, "tid": tid,
                           "ts": span["start"], "dur": span["end"] - span["start"], "args": span["args"]})
        for t, split in trace["memory"]:
            events.append({"ph": "C", "name": "memory (bytes)", "pid": pid, "tid": 0, "ts": t, "args": split})
    other = {"title": title, "ranks": {t["rank"]: {key: t[key] for key in RANK_KEYS} for t in traces}}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write(path, traces, title=""):
    with open(path, "w") as f:
        json.dump(chrome(traces, title), f)


def read(path):
    """(traces, title) from a JSON that write() made."""
    with open(path) as f:
        data = json.load(f)
    other = data["otherData"]
    ranks = sorted({e["pid"] for e in data["traceEvents"]})
    traces = {r: {"rank": r, **other["ranks"][str(r)], "spans": [], "memory": []} for r in ranks}
    for e in data["traceEvents"]:
        trace = traces[e["pid"]]
        if e["ph"] == "X":
            trace["spans"].append({"cat": e["cat"], "name": e["name"], "start": e["ts"],
                                   "end": e["ts"] + e["dur"], "args": e["args"]})
        elif e["ph"] == "C":
            trace["memory"].append([e["ts"], e["args"]])
    return [traces[r] for r in ranks], other["title"]


# ---------------------------------------------------------------- what the spans say

def merged(intervals):
    """Sorted, disjoint [start, end) covering the same time."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def length(intervals):
    return sum(end - start for start, end in intervals)


def intersect(a, b):
    """The time in both of two merged lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append([start, end])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b):
    """The time in a (merged) and not in b (merged)."""
    out = []
    for start, end in a:
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                out.append([start, b_start])
            start = max(start, b_end)
        if start < end:
            out.append([start, end])
    return out


def of(trace, cat):
    return [s for s in trace["spans"] if s["cat"] == cat]


def busy(trace):
    """When the rank computed: inside a phase, and not blocked in a wait."""
    return subtract(merged([s["start"], s["end"]] for s in of(trace, "phase")),
                    merged([s["start"], s["end"]] for s in of(trace, "wait")))


def overlap(trace):
    """(time some collective was in flight, the part of it while the rank computed), µs."""
    in_flight = merged([s["start"], s["end"]] for s in of(trace, "comm"))
    return length(in_flight), length(intersect(in_flight, busy(trace)))


def peak(trace):
    """(bytes, time, {category: bytes}) at the first moment of the highest total."""
    t, split = max(trace["memory"], key=lambda sample: (sum(sample[1].values()), -sample[0]))
    return sum(split.values()), t, split


def during(trace, t):
    """What the rank was doing at time t: 'backward, in lm_head backward'."""
    def inner(cat):
        spans = [s for s in of(trace, cat) if s["start"] <= t < s["end"]]
        return min(spans, key=lambda s: s["end"] - s["start"])["name"] if spans else None
    phase, layer = inner("phase") or "between phases", inner("layer")
    return f"{phase}, in {layer}" if layer else phase


def summary(traces):
    """What the command line prints: the share of communication hidden under
    compute, the waiting, and the peak; all from the spans and the curve."""
    flights = [overlap(t) for t in traces]
    in_flight, hidden = sum(f for f, _ in flights), sum(h for _, h in flights)
    top = max(traces, key=lambda t: peak(t)[0])
    size, t, split = peak(top)
    return {"comm_us": in_flight / len(traces),
            "hidden": hidden / in_flight if in_flight else None,
            "waiting_us": [length(merged([s["start"], s["end"]] for s in of(tr, "wait"))) for tr in traces],
            "step_us": max(max((s["end"] for s in of(tr, "phase")), default=0) for tr in traces),
            "peak": {"bytes": size, "rank": top["rank"], "us": t, "where": during(top, t), "split": split}}


def summary_line(name, traces):
    """One line: 'ddp: 62.0% of the 80.1 ms with a collective in flight hidden under compute; ...'."""
    s = summary(traces)
    hidden = "no communication" if s["hidden"] is None else \
        f"{s['hidden']:.1%} of the {s['comm_us'] / 1e3:.1f} ms with a collective in flight hidden under compute"
    waits = " / ".join(f"{w / 1e3:.1f}" for w in s["waiting_us"])
    p = s["peak"]
    return (f"{name}: {hidden}; waited {waits} ms (rank {' / '.join(str(t['rank']) for t in traces)}) "
            f"of a {s['step_us'] / 1e3:.1f} ms step; peak {p['bytes'] / 2**20:.2f} MiB on rank {p['rank']} "
            f"at {p['us'] / 1e3:.1f} ms ({p['where']})")
