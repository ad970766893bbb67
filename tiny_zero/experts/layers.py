"""The expert-parallel MoE layer: the router on every rank, each expert on
one rank of the expert group, tokens sent to their expert and back.

A rank holds: the router (a data-parallel parameter, as the rest of the
model); E/P experts of the E, whole (LocalExperts: rank i of the P ranks of
the expert group holds experts i*E/P .. (i+1)*E/P - 1).
Collectives, in an expert group, every forward of an MoE layer:
  1. all_to_all of the counts: how many of this rank's token picks go to each
     expert (E numbers), so that every rank knows what it will receive;
  2. all_to_all of the tokens (dispatch), uneven: each token to the rank of
     each of its top-k experts;
  3. all_to_all of the experts' outputs (combine), back to the tokens' ranks,
     which weight them by the router's weights and sum.
In backward, autograd runs 3 and 2 in reverse: the same all_to_alls, the
sizes swapped. Dropless: every pick is computed, none dropped for capacity.
An expert that gets no token computes on zero rows, and its rank still
takes part in every all_to_all: no rank waits on another's routing beyond
the count exchange. The counts are read on the host (the split sizes of
2 and 3): one wait per layer for a number of the data, as every dropless
all-to-all has.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from .router import route


class LocalExperts:
    """This rank's experts, first .. first + count - 1 of the block's: of its
    3-D tensors up (E, up width, d) and down (E, d, width), where up holds
    [gate; up] when gated (SwiGLU, Mixtral), this rank keeps those rows. Not
    an nn.Module: the data-parallel wrapper never sees these parameters (the
    expert-parallel wrapper averages them over the ranks that hold the same
    experts)."""

    def __init__(self, names, up, down, act, gated, first, count):
        self.names = names  # the module's names of (up, down), as module.state_dict() has them
        self.up = nn.Parameter(up.detach()[first:first + count].clone(), requires_grad=up.requires_grad)
        self.down = nn.Parameter(down.detach()[first:first + count].clone(), requires_grad=down.requires_grad)
        self.act, self.gated, self.first = act, gated, first

    def params(self):
        return [self.up, self.down]

    def compute(self, e, x):
        """Local expert e on the rows x."""
        h = F.linear(x, self.up[e])
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return F.linear(h, self.down[e])


class ExpertParallelMoE(nn.Module):
    """A sparse MoE block whose experts are spread over the expert group.
    The router keeps the block's name for it (router_name: the module's
    parameter names stay as they were)."""

    def __init__(self, router, router_name, experts, num_experts, top_k, group, group_size, jitter_noise=0.0):
        super().__init__()
        self.router_name = router_name
        setattr(self, router_name, router)
        self.__dict__["experts"] = experts  # a plain attribute, kept out of the module's parameters (LocalExperts)
        self.num_experts, self.top_k, self.jitter_noise = num_experts, top_k, jitter_noise
        self.group, self.group_size = group, group_size
        self.router_logits = None  # the last forward's, for a model's auxiliary loss
        self.path = "experts"  # its name in the model, set by the wrapper

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        if self.training and self.jitter_noise > 0:
            h = h * torch.empty_like(h).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        routed = getattr(self, self.router_name)(h)
        if isinstance(routed, tuple):  # a router that routes (Mixtral's): logits, weights, experts
            logits, weights, chosen = routed
        else:
            logits = routed
            weights, chosen = route(logits, self.top_k)
        self.router_logits = logits
        return self.dispatch_compute_combine(h, weights, chosen).view(x.shape)

    def dispatch_compute_combine(self, h, weights, chosen):
        picks = chosen.reshape(-1)
        order = torch.argsort(picks, stable=True)  # the picks, grouped by expert (so by rank)
        tokens = order // self.top_k
        counts = torch.bincount(picks, minlength=self.num_experts)
        received = torch.empty_like(counts)
        comm.where = f"{self.path} dispatch"  # what the timeline and a hang's error name
        comm.all_to_all(received, counts, group=self.group)  # STRATEGY: 1, the counts
        sizes = torch.stack([counts, received]).view(2, self.group_size, -1)  # [to / from rank i, local expert e]
        sent, arriving = sizes.tolist()  # the one host read: the split sizes of the next two all-to-alls
        sent_sizes, received_sizes = [sum(row) for row in sent], [sum(row) for row in arriving]
        rows = AllToAll.apply(h[tokens], received_sizes, sent_sizes, self.group)  # STRATEGY: 2, dispatch
        outputs = self.compute_experts(rows, sizes[1], [sum(column) for column in zip(*arriving)])
        comm.where = f"{self.path} combine"
        back = AllToAll.apply(outputs, sent_sizes, received_sizes, self.group)  # STRATEGY: 3, combine
        weighted = (back * weights.reshape(-1)[order, None]).to(h.dtype)
        return torch.zeros_like(h).index_add(0, tokens, weighted)

    def compute_experts(self, rows, received, per_expert):
        """Each local expert on its rows. rows arrive by source rank, then by
        expert (received[i, e] of them from rank i for expert e); they are
        computed by expert (per_expert rows each), and returned in arrival order."""
        local = received.shape[1]
        expert_of_row = torch.arange(local, device=rows.device).repeat(self.group_size)
        expert_of_row = expert_of_row.repeat_interleave(received.reshape(-1), output_size=len(rows))  # no read
        by_expert = torch.argsort(expert_of_row, stable=True)
        chunks = rows[by_expert].split(per_expert)
        outputs = torch.cat([self.experts.compute(e, chunk) for e, chunk in enumerate(chunks)])
        return outputs[torch.argsort(by_expert)]


def send_rows(x, out_sizes, in_sizes, group):
    """x's rows, in_sizes[i] of them to rank i; out_sizes[i] rows come from rank i."""
    out = x.new_empty((sum(out_sizes), *x.shape[1:]))
    comm.all_to_all(out, x.contiguous(), group=group, out_sizes=out_sizes, in_sizes=in_sizes)  # STRATEGY
    return out


class AllToAll(torch.autograd.Function):
    """send_rows, whose backward sends the grads back the way the rows came."""

    @staticmethod
    def forward(ctx, x, out_sizes, in_sizes, group):
        ctx.sizes, ctx.group = (out_sizes, in_sizes), group
        return send_rows(x, out_sizes, in_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        out_sizes, in_sizes = ctx.sizes
        comm.where = "an MoE layer's all-to-all, backward"
        return send_rows(grad, in_sizes, out_sizes, ctx.group), None, None, None
