"""TensorMemory counts live tensor storage bytes exactly."""
import gc

import torch
import torch.nn as nn

from tiny_zero.memory import TensorMemory


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
