"""TensorMemory counts live tensor storage bytes exactly; with it, zero3 and
fsdp hold no more gathered parameters than their formula allows."""
import gc
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tiny_zero.measure.memory import TensorMemory

sys.path.insert(0, str(Path(__file__).parent))
from harness import run_checks  # noqa: E402

GATHERED = ["zero3", "fsdp"]


def test_allocation_raises_current_and_peak_by_its_bytes():
    with TensorMemory() as memory:
        x = torch.ones(1000, dtype=torch.float32)
        assert (memory.current, memory.peak) == (4000, 4000)
        y = torch.zeros(10, 10, dtype=torch.float16)
        assert (memory.current, memory.peak) == (4200, 4200)
        z = torch.tensor([1.0, 2.0])  # made from Python data, not by an op
        assert (memory.current, memory.peak) == (4208, 4208)
    del x, y, z


def test_freeing_lowers_current_but_not_peak():
    with TensorMemory() as memory:
        x = torch.empty(1000)
        y = torch.empty(500)
        del x
        assert (memory.current, memory.peak) == (2000, 6000)
        del y
        gc.collect()
        assert (memory.current, memory.peak) == (0, 6000)
        memory.reset_peak()
        assert memory.peak == 0


def test_views_and_in_place_ops_do_not_count_again():
    with TensorMemory() as memory:
        x = torch.empty(1000)
        views = [x[10:], x.view(10, 100), x.view(10, 100).t(), x.add_(1)]
        assert memory.current == 4000
        del x
        assert memory.current == 4000  # the views keep the storage alive
        del views
        assert memory.current == 0


def test_tensors_made_before_count_only_when_tracked():
    before = torch.empty(250)
    with TensorMemory() as memory:
        before.mul_(2)  # touching it allocates nothing
        assert memory.current == 0
        memory.track(before, [before[1:]], {"again": before})  # one storage, counted once
        assert memory.current == 1000
        memory.track(before)
        assert memory.current == 1000
    del before
    assert memory.current == 0


def test_tracks_model_state_gradients_and_optimizer_state():
    model = nn.Linear(100, 10)  # 1010 parameters
    param_bytes = 1010 * 4
    with TensorMemory() as memory:
        memory.track(model.parameters())
        assert memory.current == param_bytes
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        model(torch.randn(8, 100)).sum().backward()
        opt.step()
        gc.collect()
        # params + grads + exp_avg + exp_avg_sq, plus each parameter's step counter
        steps = 2 * torch.tensor(0.0).element_size()
        assert memory.current == 4 * param_bytes + steps
        assert memory.peak > memory.current  # the input and activations came and went
        opt.zero_grad()  # set_to_none: the grads go
        assert memory.current == 3 * param_bytes + steps


def test_other_devices_and_meta_are_not_counted():
    with TensorMemory(device="cuda") as memory:
        x = torch.empty(100)  # cpu
        assert memory.current == 0
    with TensorMemory() as memory:
        m = torch.empty(100, device="meta")
        assert memory.current == 0
    assert memory.cuda_peak == (torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None)
    del x, m


def test_breakdown_of_a_plain_model_and_its_optimizer():
    """Parameters, grads and AdamW state by identity; what autograd saved
    for backward is activations until backward frees it; the rest is other."""
    model = nn.Linear(100, 10)  # 1010 parameters
    param_bytes = 1010 * 4
    with TensorMemory() as memory:
        memory.track(model.parameters())
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        memory.attach(model, opt)
        assert memory.breakdown()["parameters"] == param_bytes
        x = torch.randn(8, 100)  # saved by the linear layer (for the weight's grad)
        y = model(x)             # not saved: tanh keeps its output
        z = torch.tanh(y)
        loss = z.sum()
        after_forward = memory.breakdown()
        assert after_forward["activations"] == 8 * 100 * 4 + 8 * 10 * 4  # x and z
        assert after_forward["other"] == 8 * 10 * 4 + 4  # y and the loss
        loss.backward()
        opt.step()
        gc.collect()
        held = memory.breakdown()
        steps = 2 * 4  # each parameter's step counter
        assert (held["parameters"], held["gradients"], held["optimizer_state"]) == \
            (param_bytes, param_bytes, 2 * param_bytes + steps)
        assert held["activations"] == 0  # backward released what it saved; x, z are plain tensors now
        assert held["other"] == 8 * 100 * 4 + 2 * 8 * 10 * 4 + 4
        assert sum(held.values()) == memory.current
        assert sum(memory.peak_breakdown.values()) == memory.peak
        del x, y, z, loss
        memory.reset_peak()
        assert memory.peak_breakdown == memory.breakdown()
        assert sum(memory.peak_breakdown.values()) == memory.peak == memory.current


def test_breakdown_is_taken_at_the_peak():
    model = nn.Linear(10, 10, bias=False)
    with TensorMemory() as memory:
        memory.track(model.parameters())
        memory.attach(model)
        temporary = torch.empty(1000)  # the peak: 4000 bytes of other
        del temporary
        torch.empty(10)
        assert memory.peak == 400 + 4000
        assert memory.peak_breakdown["other"] == 4000
        assert memory.peak_breakdown["parameters"] == 400


def test_without_attach_everything_is_other_or_activations():
    with TensorMemory() as memory:
        x = torch.randn(10, requires_grad=True)
        y = x.exp()  # saves its output
        breakdown = memory.breakdown()
        assert breakdown["activations"] == 40 and breakdown["other"] == 40
        assert memory.peak_breakdown is None
    assert memory.cuda_reserved_peak == (torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None)
    del y


def test_the_tensor_that_sets_the_peak_is_classified_once_stored():
    """The breakdown waits until the storages change again, so a tensor
    allocated at the peak and then stored (here as optimizer state) is found."""
    model = nn.Linear(10, 10, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    with TensorMemory() as memory:
        memory.track(model.parameters())
        memory.attach(model, opt)
        opt.state[model.weight]["exp_avg"] = torch.zeros(1000)  # the peak, stored right after
        assert memory.peak_breakdown["optimizer_state"] == 4000
        opt.state.clear()  # freed: the peak's breakdown stays
        assert memory.peak == 4400 and memory.peak_breakdown["parameters"] == 400
        assert memory.peak_breakdown["optimizer_state"] == 4000 and memory.peak_breakdown["other"] == 0


@pytest.fixture(scope="module")
def gathered_world2():
    return run_checks(2, "memory_checks", [(name, "gathered_memory", (name,)) for name in GATHERED]
                      + [(("counts", name), "step_counts", (name,)) for name in GATHERED])


@pytest.fixture(scope="module")
def gathered_world1():
    return run_checks(1, "memory_checks", [(name, "step_counts", (name,)) for name in GATHERED])


@pytest.mark.parametrize("name", GATHERED)
def test_gathered_parameters_are_one_unit_and_the_next_in_flight(name, gathered_world2):
    """At every gather of forward and backward: the layer's units and the one
    in flight, no more (the peak: the two largest units); after forward and
    after backward nothing gathered (tests/memory_checks.py)."""
    failures = [f for rank_failures, _ in gathered_world2[name] for f in rank_failures]
    assert not failures, "\n".join(failures[:20])
    assert all(peak["backward"] > 0 for _, peak in gathered_world2[name])  # it did measure


@pytest.mark.parametrize("name", GATHERED)
def test_world_of_one_gathers_frees_and_sends_nothing(name, gathered_world1):
    """At world 1 a rank keeps every unit whole: no step (the first, which
    records the gather order, included) sends a collective, points a
    parameter elsewhere, or resizes a buffer."""
    (counts, _), = gathered_world1[name]
    assert counts == [{"calls": {}, "data": 0, "resizes": 0}] * len(counts)


@pytest.mark.parametrize("name", GATHERED)
def test_a_unit_is_gathered_once_per_use_not_per_layer(name, gathered_world2):
    """At world 2, after the recording step: each unit's collectives go once
    each time the order reaches it, in forward and in backward (gpt_tiny's
    blocks hold several layers each), and each parameter another rank owns
    or shares is pointed at the gathered values and back, once per gather."""
    for counts, per_unit in gathered_world2["counts", name]:
        for step in counts[1:]:
            gathers = step["calls"].get("broadcast", 0) + step["calls"].get("all_gather", 0)
            assert (gathers, step["data"]) == (per_unit["gathers"], per_unit["data"]), step
            assert step["resizes"] == 2 * per_unit["units"], step
