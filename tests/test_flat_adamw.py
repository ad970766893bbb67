"""tiny_zero.optim.AdamW over flat buffers: a param group's parameters become
views of one buffer per dtype and device, stepped with one update, and it
still behaves as torch.optim.AdamW does: parity over steps with two groups, a
frozen parameter, a parameter without grad in a step, a tied weight, an lr
schedule, a group added late; fp32 masters for bf16; torch's state_dict format
both ways; a parameter whose data is replaced after the flattening."""
import io

import pytest
import torch
import torch.nn as nn

import tiny_zero.optim.drop_in as adamw_module
from tiny_zero.optim import AdamW

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)


class Tiny(nn.Module):
    """An embedding tied to the output head, a hidden layer, a frozen layer and a late one."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.late = nn.Linear(6, 6)  # its grad is None in some steps, and joins as a group of its own
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.to(dtype)

    def forward(self, idx, use_late):
        h = torch.tanh(self.hidden(self.embed(idx)))
        h = self.frozen(h)
        if use_late:
            h = self.late(h)
        return self.head(h).float().logsumexp(-1).mean()

    def groups(self):
        return [{"params": [self.embed.weight, self.hidden.weight, self.frozen.weight]},
                {"params": [self.hidden.bias, self.frozen.bias], "lr": 3e-2, "weight_decay": 0.2}]


def train(model, opt, steps, decay=False, late_from=2):
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == late_from:
            opt.add_param_group({"params": list(model.late.parameters())})
        idx = torch.randint(0, 11, (4, 5), generator=gen)
        model(idx, use_late=step % 3 != 1).backward()
        opt.step()
        for group in opt.param_groups if decay else ():  # an lr schedule, written as torch's schedulers write it
            group["lr"] *= 0.7
        opt.zero_grad(set_to_none=step != 4)  # step 5 steps with zero grads (not None), as torch does


def test_parity_with_torch_adamw_two_groups_frozen_tied_no_grad_schedule():
    ours, ref = Tiny(), Tiny()
    opt, ref_opt = AdamW(ours.groups(), **HYPER), torch.optim.AdamW(ref.groups(), **HYPER)
    train(ours, opt, 7, decay=True)
    train(ref, ref_opt, 7, decay=True)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    # the group's fp32 parameters that train are views of one flat buffer; the frozen one is not
    storage = ours.embed.weight.untyped_storage().data_ptr()
    assert ours.hidden.weight.untyped_storage().data_ptr() == storage
    assert ours.frozen.weight.untyped_storage().data_ptr() != storage
    # a parameter without grad in a step keeps its count; one that joined late counts from then
    late = ours.late.weight
    assert opt.state[late]["step"] == ref_opt.state[ref.late.weight]["step"].item() == 4
    assert opt.state[ours.embed.weight]["step"] == 7
    assert ours.frozen.weight not in opt.state
    torch.testing.assert_close(opt.state[late]["exp_avg"], ref_opt.state[ref.late.weight]["exp_avg"],
                               rtol=0, atol=0)


def test_one_update_per_group_and_dtype(monkeypatch):
    calls = []
    real = adamw_module.adamw_update_
    monkeypatch.setattr(adamw_module, "adamw_update_", lambda *a, **k: calls.append(a[0].numel()) or real(*a, **k))
    model = Tiny()
    params = [model.embed.weight, model.hidden.weight, model.hidden.bias]
    low = nn.Parameter(torch.randn(5).bfloat16())
    opt = AdamW([{"params": params + [low]}], **HYPER)
    model(torch.arange(5).view(1, 5), use_late=False).backward()
    low.grad = torch.ones_like(low)
    opt.step()
    assert sorted(calls) == sorted([5, sum(p.numel() for p in params)])  # fp32 and bf16: one update each
    calls.clear()
    model.hidden.bias.grad = None  # the last fp32 parameter does not step: still one stretch
    opt.step()
    assert sorted(calls) == sorted([5, model.embed.weight.numel() + model.hidden.weight.numel()])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the Triton kernel over a flat buffer runs on a GPU"))])
def test_bf16_params_step_fp32_masters_as_an_fp32_run(device):
    """bf16 params in a flat buffer step their flat fp32 masters: the masters follow
    torch.optim.AdamW on fp32 copies given the same grads, and each param is its master rounded."""
    low, ref = Tiny(torch.bfloat16).to(device), Tiny().to(device)
    with torch.no_grad():
        for p, q in zip(low.parameters(), ref.parameters()):
            q.copy_(p.float())
    opt, ref_opt = AdamW(low.groups(), **HYPER), torch.optim.AdamW(ref.groups(), **HYPER)
    gen = torch.Generator().manual_seed(2)
    for step in range(5):
        for p, q in zip(low.parameters(), ref.parameters()):
            if p.requires_grad and not (step == 2 and p is low.hidden.bias):
                q.grad = torch.randn(q.shape, generator=gen).bfloat16().float().to(device)
                p.grad = q.grad.bfloat16()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for p, q in zip(low.parameters(), ref.parameters()):
        if p in opt.state:  # a parameter of the groups (the late layer is in none)
            master = opt.state[p]["master"]
            torch.testing.assert_close(master, q.detach(), rtol=1e-6, atol=1e-6)
            assert torch.equal(p.detach(), master.bfloat16())
    assert opt.state[low.hidden.bias]["step"] == 4


def test_state_dict_loads_into_torch_adamw_and_back():
    ours, ref = Tiny(), Tiny()
    opt = AdamW(ours.groups(), **HYPER)
    train(ours, opt, 4, late_from=99)
    saved = opt.state_dict()
    for state in saved["state"].values():  # torch's format, and each tensor its parameter's own
        assert state["step"].dtype == torch.float32 and state["step"].device.type == "cpu"
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key]._base is None and state[key].untyped_storage().nbytes() == state[key].nbytes
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    with torch.no_grad():
        for p, q in zip(ours.parameters(), ref.parameters()):
            q.copy_(p)
    ref_opt = torch.optim.AdamW(ref.groups(), **HYPER)
    ref_opt.load_state_dict(torch.load(buffer))
    for _ in range(2):
        train(ours, opt, 1, late_from=99)
        train(ref, ref_opt, 1, late_from=99)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))
    # and back: torch's state into ours, which has stepped (its flat buffers take the loaded state)
    for state in opt.state.values():
        state["exp_avg"].zero_()  # would be kept if the load did not reach the flat buffers
    opt.load_state_dict(ref_opt.state_dict())
    for _ in range(2):
        train(ours, opt, 1, late_from=99)
        train(ref, ref_opt, 1, late_from=99)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert opt.state[ours.hidden.weight]["step"] == ref_opt.state[ref.hidden.weight]["step"].item() == 8


def test_a_parameter_whose_data_is_replaced_is_stepped_with_its_new_data():
    ours, ref = Tiny(), Tiny()
    opt, ref_opt = AdamW(ours.groups(), **HYPER), torch.optim.AdamW(ref.groups(), **HYPER)
    train(ours, opt, 2, late_from=99)
    train(ref, ref_opt, 2, late_from=99)
    for model in (ours, ref):
        model.hidden.weight.data = torch.full((6, 6), 0.5)  # no longer in the flat buffer
    train(ours, opt, 2, late_from=99)
    train(ref, ref_opt, 2, late_from=99)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert ours.hidden.weight.untyped_storage().data_ptr() == ours.embed.weight.untyped_storage().data_ptr()
