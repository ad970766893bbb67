"""Ulysses (DeepSpeed's sequence parallelism): each of the C ranks of a
context group holds its q, k, v for a contiguous 1/C of the sequence; an
all-to-all trades the sequence split for a head split, attention runs on
whole sequences of 1/C of the heads, and an all-to-all trades back.

A rank holds: its slice of the sequence for every head, and, within
attention, the whole sequence for its 1/C of the heads (of the key/value
heads too under GQA, so both counts must divide by C).
Collectives: forward, one all_to_all each for q, k and v, and one for the
output; backward, the same four, the other way.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm

attend = F.scaled_dot_product_attention  # torch's own, kept before the wrapper swaps in its own


def contiguous_positions(rank, size, length, device=None):
    """The positions of the sequence rank `rank` of `size` holds: the rank-th of size equal slices."""
    share = length // size
    return torch.arange(rank * share, (rank + 1) * share, device=device)


def check_heads(heads, kv_heads, size):
    if heads % size or kv_heads % size:
        raise ValueError(f"Ulysses gives each of the {size} ranks of the context group whole heads: {heads} query "
                         f"heads and {kv_heads} key/value heads must both divide by {size}. Use a context group "
                         "that divides them, or method='ring'")


def ulysses_attention(q, k, v, group=None, is_causal=False, scale=None):
    """F.scaled_dot_product_attention over the whole sequence, from this rank's
    contiguous share of q, k, v (..., heads, tokens, head dim). Returns this
    rank's share of the output."""
    size = dist.get_world_size(group)
    check_heads(q.shape[-3], k.shape[-3], size)
    q, k, v = (SequenceToHeads.apply(t, group) for t in (q, k, v))  # STRATEGY: whole sequence, 1/C of the heads
    out = attend(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=q.shape[-3] != k.shape[-3])
    return HeadsToSequence.apply(out, group)  # STRATEGY: back to this rank's tokens, every head


def trade(x, group, size, sequence_to_heads):
    """(..., heads, tokens, d) of this rank's tokens -> (..., heads/C, C*tokens, d)
    of this rank's heads, or back. Chunk i of what goes out is rank i's; what
    comes in, chunk i from rank i."""
    if sequence_to_heads:
        out = x.unflatten(-3, (size, -1)).movedim(-4, 0)  # (C, ..., heads/C, tokens, d): head group i for rank i
    else:
        out = x.unflatten(-2, (size, -1)).movedim(-3, 0)  # (C, ..., heads/C, tokens/C, d): rank i's tokens
    chunks = out.contiguous()
    received = torch.empty_like(chunks)
    comm.all_to_all(received, chunks, group=group)  # STRATEGY
    if sequence_to_heads:
        return received.movedim(0, -3).flatten(-3, -2)  # rank i's tokens come i-th: the sequence in order
    return received.movedim(0, -4).flatten(-4, -3)  # head group i came from rank i


class SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return trade(x, group, dist.get_world_size(group), True)

    @staticmethod
    def backward(ctx, grad):
        return trade(grad, ctx.group, dist.get_world_size(ctx.group), False), None


class HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return trade(x, group, dist.get_world_size(group), False)

    @staticmethod
    def backward(ctx, grad):
        return trade(grad, ctx.group, dist.get_world_size(ctx.group), True), None
