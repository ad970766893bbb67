"""The router: which experts a token goes to, with what weight, and the
losses that keep the experts evenly loaded.

route() is Mixtral's: a softmax over the experts, the top k, renormalised
to sum to 1. load_balancing_loss() is Switch's and Mixtral's auxiliary loss
(Hugging Face's load_balancing_loss_func, the same arguments and formula):
E * sum_e f_e * P_e, with f_e the share of the top-k picks that went to
expert e and P_e the mean router probability of e, over every layer's
tokens. router_z_loss() is ST-MoE's: the mean squared log-sum-exp of the
router logits.

Both are means over the whole batch, and the whole batch is spread over the
ranks. Under an expert-parallel wrapper (over_the_world) the counts and sums
go round the world first: a rank holds its tokens' logits; it sends one
all_reduce of [counts, probability sums, rows] per loss. The value is the
whole batch's loss on every rank; the grad is N times this rank's share of
it, which the data-parallel average over the N ranks turns into the whole
batch's grad.
"""
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .. import comm

world_size = 1  # the ranks whose tokens make up the batch, while over_the_world() holds


@contextmanager
def over_the_world(size):
    """For the length of a forward: the losses below are the whole world's."""
    global world_size
    world_size = size
    try:
        yield
    finally:
        world_size = 1


def route(logits, top_k):
    """(weights, experts), each (tokens, top_k): the top_k most probable
    experts of each token and their probabilities, renormalised (Mixtral)."""
    probs = F.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def load_balancing_loss(gate_logits, num_experts, top_k=2, attention_mask=None):
    """Switch/Mixtral's auxiliary loss over gate_logits, a tuple of each MoE
    layer's (tokens, experts) router logits; attention_mask (batch, length)
    leaves padding out."""
    if not isinstance(gate_logits, tuple) or not gate_logits:
        return 0
    device = gate_logits[0].device
    picks = torch.zeros(num_experts, device=device)
    prob_sums = torch.zeros(num_experts, device=device)
    rows = torch.zeros((), device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
    for logits in gate_logits:
        probs = F.softmax(logits.to(device).float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        counted = torch.ones(len(probs), device=device) if mask is None else mask
        picks = picks.scatter_add(0, chosen.reshape(-1), counted.repeat_interleave(top_k))
        prob_sums = prob_sums + (probs * counted[:, None]).sum(dim=0)
        rows = rows + counted.sum()
    return num_experts * whole_batch(lambda p, s, r: (p / r * s / r).sum(), picks, prob_sums, rows)


def router_z_loss(gate_logits):
    """ST-MoE's router z-loss over every layer's logits: mean of logsumexp²."""
    squares = torch.cat([torch.logsumexp(logits.float(), dim=-1) ** 2 for logits in gate_logits])
    rows = torch.tensor(float(len(squares)), device=squares.device)
    return whole_batch(lambda _, s, r: s / r, squares.new_zeros(()), squares.sum(), rows)


def whole_batch(loss, counts, sums, rows):
    """loss(counts, sums, rows) over the whole batch: on one rank, as it is;
    over the world, with the world's counts, sums and rows (sums keep this
    rank's grad, times N: the data-parallel average divides by N)."""
    if world_size == 1:
        return loss(counts, sums, rows)
    stats = torch.cat([counts.reshape(-1), sums.detach().reshape(-1), rows.reshape(1)]).float()
    comm.all_reduce(stats)  # STRATEGY: the batch's statistics, from every rank's tokens
    counts, world_sums, rows = stats[:counts.numel()], stats[counts.numel():-1].view_as(sums), stats[-1]
    total = loss(counts, world_sums, rows)
    share = loss(counts, sums, rows) * world_size  # linear in sums: this rank's part of the grad
    return share + (total - share).detach()
