"""Checks run inside spawned worlds for tests/test_context.py: ring attention
and Ulysses against F.scaled_dot_product_attention on the whole sequence."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tiny_zero.context.ring import ring_attention, zigzag_positions
from tiny_zero.context.ulysses import contiguous_positions, ulysses_attention

METHODS = {"ring": (ring_attention, zigzag_positions), "ulysses": (ulysses_attention, contiguous_positions)}
RTOL, ATOL = 1e-5, 1e-6


def differences(name, got, want):
    if torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        return []
    return [f"{name}: max difference {(got - want).abs().max().item():.3g}"]


def attention_parity(method, cases):
    """[failures] of method's attention on this rank's share against torch's on
    the whole sequence: outputs and the grads of q, k, v. cases: (is_causal,
    heads, kv_heads)."""
    attention, positions_of = METHODS[method]
    rank, size = dist.get_rank(), dist.get_world_size()
    failures = []
    for is_causal, heads, kv_heads in cases:
        g = torch.Generator().manual_seed(heads * 10 + kv_heads)
        length, dim = 4 * size, 8
        q, dout = (torch.randn(2, heads, length, dim, generator=g) for _ in range(2))
        k, v = (torch.randn(2, kv_heads, length, dim, generator=g) for _ in range(2))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*full, is_causal=is_causal, enable_gqa=heads != kv_heads)
        out.backward(dout)
        mine = positions_of(rank, size, length)
        local = [t[..., mine, :].clone().requires_grad_() for t in (q, k, v)]
        local_out = attention(*local, is_causal=is_causal)
        local_out.backward(dout[..., mine, :])
        case = f"{method} causal={is_causal} heads={heads}/{kv_heads}"
        failures += differences(f"{case} output", local_out, out[..., mine, :].detach())
        for name, a, b in zip("qkv", local, full):
            failures += differences(f"{case} d{name}", a.grad, b.grad[..., mine, :])
    return failures


def ulysses_refuses(heads, kv_heads):
    """The error Ulysses gives when the heads do not divide by the group, or None."""
    size = dist.get_world_size()
    q = torch.randn(1, heads, 2, 4)
    k = torch.randn(1, kv_heads, 2, 4)
    try:
        ulysses_attention(q, k, k, is_causal=True)
    except ValueError as e:
        return str(e)
    return f"no error with {heads}/{kv_heads} heads on {size} ranks"
