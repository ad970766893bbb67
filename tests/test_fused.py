"""The norm layers' fast path (layers.fused_norms_apply, layer_norm and
more_layers.rms_norm; the Triton kernels in tiny_zero/module/fused.py)
equals their hand-written math: outputs and input, weight and bias grads. On the CPU,
torch's fused LayerNorm; the Triton kernels in Triton's interpreter (small
sizes) and, where there is a GPU, compiled on CUDA."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tiny_zero.module import fused, layers, more_layers  # noqa: E402


def reference(x, weight, bias, eps, rms, dy):
    """The hand-written math of layers.py and more_layers.py, autograd for the grads."""
    x = x.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_() if weight is not None else None
    b = bias.detach().clone().requires_grad_() if bias is not None else None
    x32 = x.float()
    centred = x32 if rms else x32 - x32.mean(-1, keepdim=True)
    y = centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.float()
    if b is not None:
        y = y + b.float()
    y = y.to(x.dtype)
    y.backward(dy)
    return y.detach(), x.grad, (w.grad if w is not None else None), (b.grad if b is not None else None)


def fast(x, weight, bias, eps, rms, dy, via_triton=False):
    """The fast path; via_triton: the Triton kernels themselves (CPU tensors
    run them in Triton's interpreter)."""
    if via_triton:
        y, mean, rstd = fused.launch_forward(x, weight, bias, eps, rms)
        needs = (True, weight is not None, bias is not None)
        return (y, *fused.launch_backward(dy, x, weight, bias, None if rms else mean, rstd, needs, rms))
    if rms:
        y, rstd = more_layers.rms_norm(x, weight, eps)
        dx, dw = more_layers.rms_norm_backward(dy, x, weight, rstd, (True, weight is not None))
        return y, dx, dw, None
    y, mean, rstd = layers.layer_norm(x, weight, bias, eps)
    dx, dw, db = layers.layer_norm_backward(dy, x, weight, bias, mean, rstd,
                                           (True, weight is not None, bias is not None))
    return y, dx, dw, db


def compare(device, rms, dtype, shape, affine=(True, True), tol=1e-5, via_triton=False):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(device, dtype)
    dy = torch.randn(shape, generator=g).to(device, dtype)
    weight = torch.randn(shape[-1], generator=g).to(device, dtype) if affine[0] else None
    bias = torch.randn(shape[-1], generator=g).to(device, dtype) if affine[1] and not rms else None
    failures = []
    for name, want, got in zip(("y", "dx", "dweight", "dbias"), reference(x, weight, bias, 1e-5, rms, dy),
                               fast(x, weight, bias, 1e-5, rms, dy, via_triton)):
        if (want is None) != (got is None):
            failures.append(f"{name}: one path gives None")
        elif want is not None and not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
            failures.append(f"{name} {tuple(shape)} {dtype}: differs by {(got.float() - want.float()).abs().max():.2e}")
    return failures


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 37), (130, 64)])
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)])
def test_layer_norm_on_cpu_is_the_reference(shape, affine):
    assert not compare("cpu", False, torch.float32, shape, affine)


def test_layers_choose_the_fast_path_and_match_the_reference():
    """A tiny_zero LayerNorm takes the fast path on fp32 CPU input and gives
    the reference's output and grads (layers.FUSED_NORMS = False); bf16 input keeps
    the reference (fp32 statistics)."""
    from tiny_zero.module import LayerNorm
    torch.manual_seed(0)
    layer = LayerNorm(24)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(5, 6, 24)
    results = []
    for enabled in (True, False):
        layers.FUSED_NORMS = enabled
        try:
            xi = x.clone().requires_grad_()
            out = layer(xi)
            out.square().sum().backward()
            results.append((out, xi.grad, layer.weight.grad, layer.bias.grad))
            layer.zero_grad()
        finally:
            layers.FUSED_NORMS = True
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    apply = layers.fused_norms_apply
    assert apply(x, 1, (layer.weight,)) and not apply(x.bfloat16(), 1, (layer.weight,))


def test_the_fast_path_is_chosen_where_it_applies():
    x = torch.randn(3, 8)
    assert layers.fused_norms_apply(x, 1) and not layers.fused_norms_apply(x, 2)  # LayerNorm over one dim
    assert not layers.fused_norms_apply(x, 1, rms=True)  # RMSNorm on the CPU: the hand-written form
    assert not layers.fused_norms_apply(torch.randn(2, fused.MAX_ROW + 1), 1)


INTERPRETED = """
import json, torch
import tests.test_fused as t
shapes = [(1, 5), (70, 37), (3, 2, 64)]  # one row; rows across two backward programs; 3-D
failures = []
for rms in (False, True):
    for shape in shapes:
        failures += t.compare("cpu", rms, torch.float32, shape, via_triton=True)
failures += t.compare("cpu", False, torch.float32, (70, 37), affine=(False, False), via_triton=True)
failures += t.rms_variants_in_the_interpreter()
print(json.dumps(failures))
"""


def rms_variants_in_the_interpreter():
    """Hugging Face's cast of x̂ before the scale, and Gemma's 1 + w: the
    Triton kernels against the tiny_zero RMSNorm's hand-written math."""
    from tiny_zero.module import RMSNorm
    failures = []
    for cast_first, offset in ((True, 0.0), (False, 1.0)):
        torch.manual_seed(0)
        layer = RMSNorm(37, eps=1e-6)
        layer.cast_before_scale, layer.weight_offset = cast_first, offset
        with torch.no_grad():
            layer.weight.normal_()
        x = torch.randn(70, 37, requires_grad=True)
        layers.FUSED_NORMS = False
        out = layer(x)
        out.square().sum().backward()
        want = (out.detach(), x.grad, layer.weight.grad)
        y, rstd = fused.launch_forward(x.detach(), layer.weight.detach(), None, 1e-6, True, cast_first, offset)[::2]
        dx, dw, _ = fused.launch_backward(2 * want[0], x.detach(), layer.weight.detach(), None, None, rstd,
                                           (True, True, False), True, cast_first, offset)
        for name, a, b in zip(("y", "dx", "dw"), (y, dx, dw), want):
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-5):
                failures.append(f"rms cast_first={cast_first} offset={offset} {name}: {(a - b).abs().max():.2e}")
    return failures


def test_triton_kernels_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", INTERPRETED], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernels run only on a GPU")
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_triton_kernels_on_cuda(rms, dtype, tol):
    for shape in [(4096, 768), (1000, 1600), (3, 5, 4097)]:
        assert not compare("cuda", rms, dtype, shape, tol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernels run only on a GPU")
def test_rms_norm_variants_on_cuda_in_bf16():
    """In bf16, Hugging Face's cast before the scale changes the rounding: the
    kernels follow the layer's hand-written math."""
    from tiny_zero.module import RMSNorm
    for cast_first, offset in ((True, 0.0), (False, 1.0), (False, 0.0)):
        torch.manual_seed(0)
        layer = RMSNorm(768, eps=1e-6).cuda().bfloat16()
        layer.cast_before_scale, layer.weight_offset = cast_first, offset
        x = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
        results = []
        for enabled in (True, False):
            layers.FUSED_NORMS = enabled
            try:
                xi = x.clone().requires_grad_()
                out = layer(xi)
                out.float().square().sum().backward()
                results.append((out.float(), xi.grad.float(), layer.weight.grad.float()))
                layer.zero_grad()
            finally:
                layers.FUSED_NORMS = True
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
