"""Every custom layer equals its torch.nn twin: outputs and input/weight/bias
grads; and swap_layers converts what it should and leaves every other module
as it is, for a strategy's hooks. (transformers' classes: tests/test_hf.py.)"""
import copy

import pytest
import torch
import torch.nn as nn

from tiny_zero.module import (Conv1D, Embedding, LayerNorm, Linear, RMSNorm, hooked_modules, layers,
                              swap_layers)

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


@pytest.mark.parametrize("ndim", [2, 3, 4])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("eps", [None, 1e-5])
def test_rmsnorm_fp32(ndim, affine, eps):
    torch.manual_seed(0)
    norm = nn.RMSNorm(7, eps=eps, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            norm.weight.normal_()
    assert_same(norm, torch.randn(SHAPES[ndim]) * 3 + 1)


@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm])
def test_norm_over_two_dims(norm):
    torch.manual_seed(0)
    layer = norm((3, 7))
    with torch.no_grad():
        layer.weight.normal_()
    assert_same(layer, torch.randn(2, 3, 7))


@pytest.mark.parametrize("ndim", [2, 3])
def test_conv1d_is_a_transposed_linear(ndim):
    """tiny_zero's Conv1D (transformers' layout, W [in, out]) against nn.Linear
    holding Wᵀ: the same output, input grad, and weight grad transposed.
    (Against transformers' own Conv1D: tests/test_hf.py.)"""
    torch.manual_seed(0)
    conv = Conv1D(5, 7)
    with torch.no_grad():
        conv.bias.normal_()
    linear = nn.Linear(7, 5)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t()), linear.bias.copy_(conv.bias)
    x = torch.randn(SHAPES[ndim])
    out_c, gx_c, g_c = grads_of(conv, x)
    out_l, gx_l, g_l = grads_of(linear, x)
    torch.testing.assert_close(out_c, out_l, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gx_c, gx_l, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_c["weight"], g_l["weight"].t(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_c["bias"], g_l["bias"], atol=1e-6, rtol=1e-6)
    assert list(conv.state_dict()) == ["weight", "bias"] and conv.weight.shape == (7, 5)


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
    rms = swap_layers(nn.Sequential(nn.RMSNorm(4)))[0].double()
    conv = Conv1D(3, 4).double()
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_(), rms.weight.normal_()
    x = torch.randn(2, 3, 4, dtype=torch.double, requires_grad=True)
    for layer in (lin, ln, rms, conv):
        assert torch.autograd.gradcheck(layer, (x,))
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
                  swap_layers(nn.Sequential(nn.LayerNorm(4)))[0].double(),
                  swap_layers(nn.Sequential(nn.RMSNorm(4)))[0].double(), Conv1D(3, 4).double()):
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
                     (nn.RMSNorm(16), torch.randn(4, 16)), (nn.Embedding(10, 8), torch.randint(0, 10, (4, 3)))):
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


def test_modules_without_a_layer_keep_their_class_and_what_they_hold():
    """Conv1d, BatchNorm1d, MultiheadAttention: not converted, and nothing
    inside them either (MultiheadAttention reads its out_proj's weight
    itself); a strategy reaches them through hooks (tests/test_hooked.py)."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Conv1d(1, 1, 2), nn.BatchNorm1d(3), nn.MultiheadAttention(4, 2))
    swap_layers(model)
    assert isinstance(model[0], Linear)
    assert [type(m) for m in model[1:]] == [nn.Conv1d, nn.BatchNorm1d, nn.MultiheadAttention]
    assert not isinstance(model[3].out_proj, Linear)
    assert [path for path, _, _ in hooked_modules(model)] == ["1", "2", "3"]


class MyLinear(nn.Linear):
    pass


class LoRALinear(nn.Linear):
    """A subclass with a forward of its own: converting it would drop the low-rank path."""

    def __init__(self, n, rank=2):
        super().__init__(n, n)
        self.a = nn.Parameter(torch.zeros(rank, n))
        self.b = nn.Parameter(torch.zeros(n, rank))

    def forward(self, x):
        return super().forward(x) + x @ self.a.t() @ self.b.t()


def test_plain_subclasses_are_converted_and_keep_their_class():
    torch.manual_seed(0)
    from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
    ref = nn.Sequential(MyLinear(7, 6), NonDynamicallyQuantizableLinear(6, 5))
    mine = swap_layers(copy.deepcopy(ref))
    for layer, cls in zip(mine, (MyLinear, NonDynamicallyQuantizableLinear)):
        assert isinstance(layer, Linear) and isinstance(layer, cls), type(layer).__mro__
    assert list(mine.state_dict()) == list(ref.state_dict())
    assert_same(ref, torch.randn(3, 7))


def test_a_subclass_with_its_own_forward_keeps_it():
    model = nn.Sequential(LoRALinear(4), LoRALinear(4), nn.Linear(4, 4))
    swap_layers(model)
    assert [type(m) for m in model[:2]] == [LoRALinear, LoRALinear] and isinstance(model[2], Linear)


class Scaled(nn.Embedding):
    """Gemma's embedding in plain torch: a forward of its own around nn.Embedding's."""

    def forward(self, idx):
        return super().forward(idx) * 2


class TiedScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = Scaled(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.emb(idx))


def test_a_subclass_with_its_own_forward_keeps_it_even_tied_to_a_converted_layer():
    """The head Linear holds the embedding's weight, and converts; the
    embedding keeps its forward, which reads the weight (a strategy gathers
    it there, through hooks)."""
    model = TiedScaled()
    swap_layers(model)
    assert type(model.emb) is Scaled and isinstance(model.head, Linear)
    assert [path for path, _, _ in hooked_modules(model)] == ["emb"]


class AliasedBias(nn.Module):
    """BERT's prediction head: its own `bias` is the decoder's bias, one tensor."""

    def __init__(self):
        super().__init__()
        self.decoder = nn.Linear(4, 6)
        self.bias = self.decoder.bias

    def forward(self, x):
        return self.decoder(x)


def test_a_parameter_aliased_outside_its_layer_is_accepted():
    mine = swap_layers(nn.Sequential(AliasedBias()))
    assert isinstance(mine[0].decoder, Linear) and mine[0].bias is mine[0].decoder.bias


def test_converted_twice_keeps_the_original_class():
    """Single device first (swap_layers), then a strategy's classes: a plain
    subclass is still an instance of its own class."""
    class Mixin:
        pass

    class MixinLinear(Mixin, Linear):
        pass

    class MixinRMSNorm(Mixin, RMSNorm):
        pass
    model = swap_layers(nn.Sequential(MyLinear(3, 3), nn.RMSNorm(3)))
    classes = {nn.Linear: MixinLinear, nn.RMSNorm: MixinRMSNorm}
    swap_layers(model, classes)
    assert isinstance(model[0], MyLinear) and isinstance(model[0], classes[nn.Linear])
    assert type(model[1]) is classes[nn.RMSNorm] and isinstance(model[1], RMSNorm)


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


def test_parameters_never_go_to_autograd():
    """A layer's output is linked in autograd's graph to its input and to one
    leaf that all layers share (it tells a backward that fills p.grad from
    torch.autograd.grad), never to a parameter: the grads go through
    grad_ready, where a strategy runs the parameters' grad hooks (linked,
    autograd would run them too, with no grad). Where the input does not
    require grad (indices, a first layer's input), the leaf makes the output
    require grad if a parameter does."""
    torch.manual_seed(0)
    emb, ln, fc = swap_layers(nn.Sequential(nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 3)))
    h = emb(torch.randint(0, 11, (3, 4)))
    assert [f for f, _ in h.grad_fn.next_functions][1:] == [layers._LEAF_NODE]
    for layer, y in ((ln, ln(h)), (fc, fc(h.detach().requires_grad_()))):
        assert [f for f, _ in y.grad_fn.next_functions][1:] == [layers._LEAF_NODE], type(layer).__name__
    ln.bias.requires_grad_(False)
    y = ln(torch.randn(3, 6))
    assert y.requires_grad and len(y.grad_fn.next_functions) == 2  # x's slot (no grad), the leaf
    y.sum().backward()
    assert ln.weight.grad is not None and ln.bias.grad is None
    ln.weight.requires_grad_(False)
    assert not ln(torch.randn(3, 6)).requires_grad  # nothing trains, nothing requires grad: as torch's


def test_autograd_grad_of_an_input_leaves_the_parameters_alone():
    """torch.autograd.grad(out, x) and backward(inputs=[x]) give x's grad and
    leave every p.grad alone, as torch's layers do; a loss.backward() after
    them fills p.grad as torch's. A backward with create_graph=True (a
    gradient penalty) is refused: the hand-written backward is not
    differentiable. Under torch.no_grad() nothing is recorded."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.RMSNorm(8), nn.Tanh(), nn.Linear(8, 3))
    mine = swap_layers(copy.deepcopy(ref))
    conv = Conv1D(4, 5)
    x = torch.randn(2, 3, 5, requires_grad=True)
    for model in (ref, mine):
        (grad_x,) = torch.autograd.grad(model(x).square().sum(), x)
        model(x).square().sum().backward(inputs=[x])
        torch.testing.assert_close(x.grad, grad_x)
        x.grad = None
        if model is mine:
            torch.testing.assert_close(grad_x, want, atol=1e-6, rtol=1e-6)
        want = grad_x
    (grad_x,) = torch.autograd.grad(conv(x).sum(), x)
    torch.testing.assert_close(grad_x, conv.weight.sum(1).expand_as(x))  # dx = dy Wᵀ with dy = 1
    assert all(p.grad is None for p in [*mine.parameters(), *conv.parameters()])
    for model in (ref, mine):
        model(x).square().sum().backward()
    for (name, r), m in zip(ref.named_parameters(), mine.parameters()):
        torch.testing.assert_close(m.grad, r.grad, atol=1e-6, rtol=1e-6, msg=name)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(mine(x).sum(), x, create_graph=True)
    with torch.no_grad():
        out = mine(x)
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, ref(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_grad_hook_on_a_parameter_is_refused(hook):
    """autograd would run a parameter's grad hook; tiny_zero's layers deliver
    grads themselves, so the hook would silently never run: backward refuses
    it with the way out, and trains again once the hook is removed."""
    torch.manual_seed(0)
    model = swap_layers(Small())
    handle = getattr(model.fc.weight, hook)(lambda arg: None)
    idx = torch.randint(0, 11, (3, 4))
    with pytest.raises(RuntimeError, match="grad hook .* would never run; remove it"):
        model(idx).square().sum().backward()
    handle.remove()
    model.zero_grad()
    model(idx).square().sum().backward()
    assert model.fc.weight.grad is not None


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

