"""Ring attention: each of the C ranks of a context group holds its queries,
keys and values for its share of the sequence; the keys and values go round
the ring, so that every query meets every key.

A rank holds: its q, k, v (the zigzag split: chunk i and chunk 2C-1-i of 2C
equal chunks on rank i, so that under a causal mask every rank has the same
work), the running output and log-sum-exp of its queries, and one block of
keys and values in flight.
Collectives: forward, C-1 steps of a P2P exchange (k and v to the next rank,
from the previous one), each overlapped with the attention of the block at
hand; the partial softmaxes merge by their log-sum-exp. Backward, the same
ring again: k and v go round a second time, and with them the grads of k and
v, which a rank adds to as they pass; one last step takes each block's grads
home.
"""
import torch
import torch.distributed as dist

from .. import comm


def zigzag_positions(rank, size, length, device=None):
    """The positions of the sequence rank `rank` of `size` holds, in order:
    chunk rank and chunk 2*size-1-rank of 2*size equal chunks."""
    chunk = length // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, last])


def ring_attention(q, k, v, group=None, is_causal=False, scale=None):
    """F.scaled_dot_product_attention over the whole sequence, from this rank's
    zigzag share of q, k, v (..., heads, tokens, head dim); the kv heads may
    be fewer than the query heads (GQA, as enable_gqa). Returns this rank's
    share of the output."""
    if q.shape[-3] % k.shape[-3]:
        raise ValueError(f"{q.shape[-3]} query heads are not a multiple of {k.shape[-3]} key/value heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, group, is_causal, scale)


class Ring:
    """The ranks of the group in a ring: this rank sends to the next, receives from the previous."""

    def __init__(self, group):
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.group, self.size, self.me = group, len(ranks), dist.get_rank(group)
        self.next, self.previous = ranks[(self.me + 1) % self.size], ranks[(self.me - 1) % self.size]

    def pass_on(self, tensor):
        """Start sending `tensor` on and receiving the previous rank's; returns
        (a wait, the buffer it fills)."""
        received = torch.empty_like(tensor)
        sends, recvs = comm.exchange([(tensor, self.next)], [(received, self.previous)], group=self.group)  # STRATEGY
        return (lambda: [p.wait() for p in sends + recvs]), received

    def source(self, step):
        """Whose keys and values this rank holds at `step`."""
        return (self.me - step) % self.size

    def meeting(self, step, is_causal, half):
        """(query rows, key columns, masked) of the block this rank computes at
        `step`. Causal, zigzag: the own block under the mask; an earlier rank's
        first chunk comes before both of this rank's, its last chunk after
        them; a later rank's two chunks come before this rank's last chunk
        only. Half of each block is all that is left to compute."""
        source, everything = self.source(step), slice(None)
        if not is_causal:
            return everything, everything, False
        if source == self.me:
            return everything, everything, True
        if source < self.me:
            return everything, slice(0, half), False
        return slice(half, None), everything, False


def expand(kv, groups):
    """Each key/value head repeated for the query heads that read it (GQA)."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


def fold(grad, groups):
    """The grads of repeated heads summed back into their key/value head."""
    return grad if groups == 1 else grad.unflatten(-3, (-1, groups)).sum(-3)


def causal_mask(ring, length, device):
    """Which of this rank's keys each of its queries may see, by their positions in the whole sequence."""
    positions = zigzag_positions(ring.me, ring.size, length * ring.size, device)
    return positions[:, None] >= positions[None, :]


def scores_of(q, k, scale, mask):
    scores = q @ k.transpose(-2, -1) * scale
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def merge(out, lse, block_out, block_lse):
    """out, lse (views of the running ones) take in a block's: the softmax over
    both, from the two partial ones, by their log-sum-exp."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, is_causal, scale):
        ring, groups, half = Ring(group), q.shape[-3] // k.shape[-3], q.shape[-2] // 2
        mask = causal_mask(ring, q.shape[-2], q.device) if is_causal else None
        qf = q.float()
        out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = (k.float(), v.float())
        for step in range(ring.size):
            if step < ring.size - 1:
                wait, received = ring.pass_on(torch.stack(kv))  # STRATEGY: the next block, while this one computes
            rows, cols, masked = ring.meeting(step, is_causal, half)
            scores = scores_of(qf[..., rows, :], expand(kv[0][..., cols, :], groups), scale, mask if masked else None)
            block_lse = scores.logsumexp(-1)
            block_out = torch.exp(scores - block_lse.unsqueeze(-1)) @ expand(kv[1][..., cols, :], groups)
            merge(out[..., rows, :], lse[..., rows], block_out, block_lse)  # STRATEGY: softmaxes merged
            if step < ring.size - 1:
                wait()
                kv = tuple(received)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.is_causal, ctx.scale = group, is_causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, groups, half = Ring(ctx.group), q.shape[-3] // k.shape[-3], q.shape[-2] // 2
        mask = causal_mask(ring, q.shape[-2], q.device) if ctx.is_causal else None
        qf, dout = q.float(), dout.float()
        delta = (dout * out).sum(-1)  # sum_j P_ij dP_ij, the softmax's backward term per query
        dq = torch.zeros_like(qf)
        kv = torch.stack((k.float(), v.float()))
        for step in range(ring.size):
            if step < ring.size - 1:
                wait_kv, next_kv = ring.pass_on(kv)  # STRATEGY: k and v round the ring again
            rows, cols, masked = ring.meeting(step, ctx.is_causal, half)
            k_at, v_at = expand(kv[0][..., cols, :], groups), expand(kv[1][..., cols, :], groups)
            scores = scores_of(qf[..., rows, :], k_at, ctx.scale, mask if masked else None)
            p = torch.exp(scores - lse[..., rows].unsqueeze(-1))
            dp = dout[..., rows, :] @ v_at.transpose(-2, -1)
            ds = p * (dp - delta[..., rows].unsqueeze(-1))
            dq[..., rows, :] += ds @ k_at * ctx.scale
            block_dkv = torch.stack((fold(ds.transpose(-2, -1) @ qf[..., rows, :] * ctx.scale, groups),
                                     fold(p.transpose(-2, -1) @ dout[..., rows, :], groups)))
            if step == 0:
                dkv = torch.zeros_like(kv)
            else:
                wait_dkv()  # the grads of this block's k and v so far, from the ranks it has passed
                dkv = received_dkv
            dkv[..., cols, :] += block_dkv
            if step < ring.size - 1:
                wait_dkv, received_dkv = ring.pass_on(dkv)  # STRATEGY: the grads go on with their block
                wait_kv()
                kv = next_kv
        if ring.size > 1:
            wait_dkv, received_dkv = ring.pass_on(dkv)  # STRATEGY: the last pass takes each block's grads home
            wait_dkv()
            dkv = received_dkv
        dk, dv = dkv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
