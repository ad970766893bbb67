"""Every custom layer equals its torch.nn twin: outputs and input/weight/bias grads."""
import copy

import pytest
import torch
import torch.nn as nn

from tiny_zero.module import Embedding, LayerNorm, Linear, swap_layers

SHAPES = {2: (5, 7), 3: (2, 3, 7), 4: (2, 2, 3, 7)}


def twins(torch_layer):
    """(torch layer, the same layer converted to tiny_zero), equal parameters."""
    mine = swap_layers(nn.Sequential(copy.deepcopy(torch_layer)))[0]
    return torch_layer, mine


def grads_of(layer, x, dtype=torch.float32):
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    out = layer(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype))
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return out, (x.grad if x.requires_grad else None), grads


def assert_same(torch_layer, x, atol=1e-6, rtol=1e-6):
    ref, mine = twins(torch_layer)
    out_r, gx_r, g_r = grads_of(ref, x)
    out_m, gx_m, g_m = grads_of(mine, x)
    torch.testing.assert_close(out_m, out_r, atol=atol, rtol=rtol)
    if gx_r is not None:
        torch.testing.assert_close(gx_m, gx_r, atol=atol, rtol=rtol)
    assert g_m.keys() == g_r.keys()
    for name in g_r:
        torch.testing.assert_close(g_m[name], g_r[name], atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize("ndim", [2, 3, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_fp32(ndim, bias):
    torch.manual_seed(0)
    assert_same(nn.Linear(7, 5, bias=bias), torch.randn(SHAPES[ndim]))


@pytest.mark.parametrize("ndim", [2, 3, 4])
@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_layernorm_fp32(ndim, affine, bias):
    torch.manual_seed(0)
    ln = nn.LayerNorm(7, elementwise_affine=affine, bias=bias)
    if affine:  # non-trivial affine parameters so their grads matter
        with torch.no_grad():
            ln.weight.normal_()
            if bias:
                ln.bias.normal_()
    assert_same(ln, torch.randn(SHAPES[ndim]) * 3 + 1)


def test_layernorm_two_normalized_dims():
    torch.manual_seed(0)
    ln = nn.LayerNorm((3, 7))
    with torch.no_grad():
        ln.weight.normal_()
    assert_same(ln, torch.randn(2, 3, 7))


@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_fp32(ndim, padding_idx):
    torch.manual_seed(0)
    idx = torch.randint(0, 11, (4, 3, 2)[:ndim])
    idx.view(-1)[0] = 2  # make sure the padding row is hit
    assert_same(nn.Embedding(11, 6, padding_idx=padding_idx), idx)


def test_gradcheck_fp64():
    """Input grads by autograd.gradcheck (the weights' grads: the test below)."""
    torch.manual_seed(0)
    lin = swap_layers(nn.Sequential(nn.Linear(4, 3)))[0].double()
    ln = swap_layers(nn.Sequential(nn.LayerNorm(4)))[0].double()
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    x = torch.randn(2, 3, 4, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lin, (x,))
    assert torch.autograd.gradcheck(ln, (x,))
    emb = swap_layers(nn.Sequential(nn.Embedding(5, 3)))[0].double()
    idx = torch.tensor([[0, 1, 1], [4, 0, 2]])
    g = torch.randn(2, 3, 3, dtype=torch.double)
    emb(idx).backward(g)
    w = emb.weight.detach().clone().requires_grad_(True)
    ref = torch.autograd.grad(torch.nn.functional.embedding(idx, w), w, g)[0]
    torch.testing.assert_close(emb.weight.grad, ref)


def test_param_grads_match_finite_differences():
    """Our hand-written dW, db, dγ, dβ against fp64 finite differences."""
    torch.manual_seed(0)
    for layer in (swap_layers(nn.Sequential(nn.Linear(4, 3)))[0].double(),
                  swap_layers(nn.Sequential(nn.LayerNorm(4)))[0].double()):
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_()
        x = torch.randn(2, 3, 4, dtype=torch.double)
        g = torch.randn(2, 3, layer(x).shape[-1], dtype=torch.double)
        layer.zero_grad()
        layer(x.requires_grad_(True)).backward(g)
        for p in layer.parameters():
            num = torch.zeros_like(p)
            for i in range(p.numel()):
                for sign in (1, -1):
                    with torch.no_grad():
                        p.view(-1)[i] += sign * 1e-6
                        num.view(-1)[i] += sign * (layer(x) * g).sum() / 2e-6
                        p.view(-1)[i] -= sign * 1e-6
            torch.testing.assert_close(p.grad, num, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    torch.manual_seed(0)
    for layer, x in ((nn.Linear(16, 8), torch.randn(4, 16)), (nn.LayerNorm(16), torch.randn(4, 16)),
                     (nn.Embedding(10, 8), torch.randint(0, 10, (4, 3)))):
        ref, mine = twins(layer)
        ref, mine = ref.to(dtype), mine.to(dtype)
        xx = x.to(dtype) if x.is_floating_point() else x
        out_r, gx_r, g_r = grads_of(ref, xx)
        out_m, gx_m, g_m = grads_of(mine, xx)
        assert out_m.dtype == dtype
        torch.testing.assert_close(out_m.float(), out_r.float(), atol=2e-2, rtol=2e-2)
        for name in g_r:
            assert g_m[name].dtype == dtype
            torch.testing.assert_close(g_m[name].float(), g_r[name].float(), atol=5e-2, rtol=5e-2)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.emb(idx))


def test_tied_weights():
    torch.manual_seed(0)
    ref = Tied()
    mine = swap_layers(copy.deepcopy(ref))
    assert mine.head.weight is mine.emb.weight
    assert isinstance(mine.emb, Embedding) and isinstance(mine.head, Linear)
    assert list(mine.state_dict()) == list(ref.state_dict())
    idx = torch.randint(0, 11, (3, 4))
    ref(idx).square().sum().backward()
    mine(idx).square().sum().backward()
    torch.testing.assert_close(mine.emb.weight.grad, ref.emb.weight.grad, atol=1e-6, rtol=1e-6)


def test_unsupported_layer_is_named():
    model = nn.Sequential(nn.Linear(3, 3), nn.Conv1d(1, 1, 2))
    with pytest.raises(TypeError, match=r"'1' \(Conv1d\).*nn.Linear, nn.LayerNorm, nn.Embedding"):
        swap_layers(model)


class Small(nn.Module):
    """Embedding -> LayerNorm -> Linear -> Linear, as a transformer's pieces."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 6)
        self.out = nn.Linear(6, 3, bias=False)

    def forward(self, idx):
        return self.out(torch.tanh(self.fc(self.ln(self.emb(idx)))))


def test_frozen_parameters_get_no_grad():
    """A frozen weight gets no grad (it is never computed); the rest are unchanged."""
    torch.manual_seed(0)
    ref = Small()
    for p in (ref.emb.weight, ref.fc.weight, ref.ln.bias):
        p.requires_grad_(False)
    mine = swap_layers(copy.deepcopy(ref))
    idx = torch.randint(0, 11, (3, 4))
    for model in (ref, mine):
        model(idx).square().sum().backward()
    for (name, r), m in zip(ref.named_parameters(), mine.parameters()):
        assert (m.grad is None) == (r.grad is None), name
        if r.grad is not None:
            torch.testing.assert_close(m.grad, r.grad, atol=1e-6, rtol=1e-6, msg=name)
    assert mine.fc.weight.grad is None and mine.fc.bias.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_follows_torch(dtype):
    """Under torch.autocast the layers compute in the dtypes torch's would, and
    backward runs (it used to fail with mismatched matmul dtypes)."""
    torch.manual_seed(0)
    ref = Small()
    mine = swap_layers(copy.deepcopy(ref))
    idx = torch.randint(0, 11, (3, 4))
    outs = []
    for model in (ref, mine):
        with torch.autocast("cpu", dtype=dtype):
            out = model(idx)
            assert model.ln(model.emb(idx)).dtype == torch.float32  # layer_norm runs in fp32 under autocast
        out.float().square().sum().backward()
        outs.append(out)
    assert outs[1].dtype == outs[0].dtype == dtype
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=2e-2, rtol=2e-2)
    for (name, r), m in zip(ref.named_parameters(), mine.parameters()):
        assert m.grad.dtype == r.grad.dtype == torch.float32, name
        torch.testing.assert_close(m.grad, r.grad, atol=3e-2, rtol=3e-2, msg=name)

