"""Context parallelism: the sequence is split across the C ranks of a context
group; the context groups are data-parallel replicas.

    ContextParallel(module, method="ring", cp_size=C)   # or method="ulysses"
    data_parallel(Zero2)(module, method="ring", cp_size=C)  # over zero2's (or fsdp's, ...) wrapper

The world is C x R ranks. Ranks r*C .. r*C + C-1 are replica r's context
group: each is given replica r's whole batch (token ids and targets, which
are small), keeps its own share of every sequence (ring: the zigzag chunks i
and 2C-1-i of 2C; Ulysses: slice i of C) and runs the unchanged module on it,
with the positions of its tokens passed as position_ids. Every layer but
attention computes token by token; for the length of the module's forward,
F.scaled_dot_product_attention is ring or Ulysses attention over the context
group (ring.py, ulysses.py).

A rank holds: every parameter, its grad and its optimizer state, as ddp's
(or what the data-parallel wrapper holds, sharded over all C x R ranks);
the activations of its 1/C of the tokens.
Collectives: in a context group, attention's (P2P of k and v around a ring, or
all-to-alls of heads) in every attention forward and backward, and one
all_reduce of the loss in forward, so that every rank returns the loss over
the whole sequence. Over the world, ddp's: an all_reduce of each bucket of
grads during backward. The grads are averaged over all C x R ranks: each
rank's backward starts from C times its share of its replica's loss, so the
average is the mean over the replicas of the grad of the whole-sequence loss.
"""
import inspect
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .. import agreements, comm
from ..ddp.wrapper import DDP
from ..distributed import init_distributed
from .ring import ring_attention, zigzag_positions
from .ulysses import attend as torch_attention
from .ulysses import contiguous_positions, ulysses_attention

METHODS = {"ring": (ring_attention, zigzag_positions, 2), "ulysses": (ulysses_attention, contiguous_positions, 1)}
TARGETS = ("targets", "labels")  # the module's argument a loss reads: the example GPT's, Hugging Face's
IGNORE_INDEX = -100  # the targets that count in no loss (F.cross_entropy's and Hugging Face's default)


class ContextSplit:
    """Context parallelism's forward over a data-parallel wrapper (the class it
    is mixed into: ddp's in ContextParallel, any with data_parallel())."""
    defer_step_agreement = False  # the loss's all_reduce runs in forward

    def __init__(self, module, method="ring", cp_size=None, **options):
        rank, world_size = init_distributed()
        cp_size = world_size if cp_size is None else cp_size
        if method not in METHODS:
            raise ValueError(f"method={method!r}: give 'ring' or 'ulysses'")
        if not isinstance(cp_size, int) or cp_size < 1 or world_size % cp_size:
            raise ValueError(f"cp_size={cp_size!r} must divide the world size {world_size} (world = cp_size x replicas)")
        self.signature = inspect.signature(module.forward)
        if "position_ids" not in self.signature.parameters:
            raise TypeError(f"{type(module).__name__}.forward takes no position_ids: every rank would number its "
                            "tokens from 0. Give it a position_ids argument (as Hugging Face models have)")
        if getattr(getattr(module, "config", None), "checkpoint_activations", False) or \
                getattr(module, "is_gradient_checkpointing", False):
            # the recomputation runs in backward, after the forward gave torch's attention back
            raise ValueError("context parallelism does not run under activation checkpointing: the recomputed "
                             "attention would see this rank's tokens only. Turn checkpointing off")
        super().__init__(module, **options)  # the data-parallel wrapper's: grads averaged over the world
        self.method, self.cp_size, self.cp_rank = method, cp_size, rank % cp_size
        self.attention, self.positions_of, self.chunks_per_rank = METHODS[method]
        # which rows of a batch this rank's context group takes, of how many (replica, in the wrapper
        # underneath, keeps its meaning: this rank among those that hold the same parameters, the world)
        self.dp_rank, self.dp_size = rank // cp_size, world_size // cp_size
        groups = [agreements.new_group(range(r * cp_size, (r + 1) * cp_size)) for r in range(self.dp_size)]
        self.context_group = next(g for g in groups if g is not None)

    def forward(self, *args, **kwargs):
        """The module on this rank's tokens of the whole sequences it is given,
        at their positions, with attention over the context group. Returns the
        loss over the whole sequences when targets are given (the GPT's
        targets, Hugging Face's labels: in its output's loss), else the
        module's output for this rank's tokens (gather_sequence joins them)."""
        call = self.signature.bind(*args, **kwargs)
        length = sequence_length(call.arguments)
        parts = self.chunks_per_rank * self.cp_size
        if length % parts:
            raise ValueError(f"a sequence of {length} tokens does not split into {parts} equal chunks ({self.method} "
                             f"on {self.cp_size} ranks): give a length that is a multiple of {parts}")
        mine = self.positions_of(self.cp_rank, self.cp_size, length, self.device)
        targets = self.whole_targets(call.arguments)
        for name, value in call.arguments.items():
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == length:
                call.arguments[name] = value[:, mine]  # STRATEGY: this rank's tokens only
        if "labels" in call.arguments and targets is not None:  # Hugging Face's loss: not shifted again
            call.arguments.setdefault(self.extra_keywords(), {})["shift_labels"] = call.arguments["labels"]
        call.arguments["position_ids"] = mine.unsqueeze(0)  # STRATEGY: rotary and learned positions follow the slice
        if "attention_mask" in self.signature.parameters and call.arguments.get("attention_mask") is None:
            # all ones: a mask Hugging Face skips (is_causal); left out, it reads the zigzag's jump as packed sequences
            rows = next(v.shape[0] for v in call.arguments.values() if torch.is_tensor(v) and v.dim() >= 2)
            call.arguments["attention_mask"] = torch.ones((rows, len(mine)), dtype=torch.long, device=self.device)
        with self.attention_over_the_group():
            out = super().forward(*call.args, **call.kwargs)
        if targets is None:
            return out
        if torch.is_tensor(out):
            return self.whole_sequence_loss(out, targets[:, mine], targets)
        out.loss = self.whole_sequence_loss(out.loss, targets[:, mine], targets)
        return out

    def whole_targets(self, arguments):
        """The targets, whole, aligned with the tokens (Hugging Face's labels
        are shifted here, on the whole sequence, and passed as shift_labels:
        a rank's last token predicts the next rank's first)."""
        name = next((n for n in TARGETS if arguments.get(n) is not None), None)
        if name is None:
            return None
        targets = arguments[name]
        if name == "labels":
            ignored = torch.full_like(targets[:, :1], IGNORE_INDEX)
            targets = torch.cat([targets[:, 1:], ignored], dim=1)
            arguments["labels"] = targets
        return targets

    def extra_keywords(self):
        """The name of the module's **kwargs, which Hugging Face passes on to its loss."""
        extra = [p.name for p in self.signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        if not extra:
            raise TypeError("the module takes labels but no **kwargs: its loss cannot be given shift_labels")
        return extra[0]

    @contextmanager
    def attention_over_the_group(self):
        """For the module's forward, torch's attention is this method's over the context group."""
        F.scaled_dot_product_attention = self.attend  # STRATEGY: the one layer that needs the other ranks' tokens
        try:
            yield
        finally:
            F.scaled_dot_product_attention = torch_attention

    def attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p:
            raise ValueError("under context parallelism attention takes no attn_mask and no dropout: pass "
                             "is_causal=True for a causal mask, and dropout_p=0")
        return self.attention(query, key, value, self.context_group, is_causal=is_causal, scale=scale)

    def whole_sequence_loss(self, loss, mine, whole):
        """The loss over the whole sequence, on every rank of the group: each
        rank's mean over its counted targets, weighted by their share. What
        backward sees is this rank's part only, times C (ddp divides by C x R)."""
        share = (mine != IGNORE_INDEX).sum() / (whole != IGNORE_INDEX).sum()
        total = (loss.detach() * share).float()
        comm.all_reduce(total, group=self.context_group)  # STRATEGY: the whole sequence's loss, on every rank
        part = loss * (share * self.cp_size)
        return part + (total.to(loss.dtype) - part.detach())

    @torch.no_grad()
    def gather_sequence(self, local, dim=1):
        """The whole sequence from every rank's share of it (outputs, for a test
        or an evaluation): a collective over the context group."""
        moved = local.movedim(dim, 0).contiguous()
        gathered = torch.empty((self.cp_size * moved.shape[0], *moved.shape[1:]), dtype=local.dtype,
                               device=local.device)
        comm.all_gather(gathered, moved, group=self.context_group)
        length = gathered.shape[0]
        order = torch.cat([self.positions_of(r, self.cp_size, length, local.device) for r in range(self.cp_size)])
        whole = torch.empty_like(gathered)
        whole[order] = gathered
        return whole.movedim(0, dim)


class ContextParallel(ContextSplit, DDP):
    """Context parallelism with ddp's wrapper: every rank holds every parameter, its grad and its state."""


def data_parallel(wrapper_class):
    """Context parallelism over another data-parallel wrapper class (Zero2, FSDP,
    ...): its optimizer steps it, as `Zero2AdamW(data_parallel(Zero2)(module, "ring"))`."""
    return type(f"Context{wrapper_class.__name__}", (ContextSplit, wrapper_class), {})


def sequence_length(arguments):
    """The length of the sequence: dimension 1 of the first tensor argument (the token ids)."""
    first = next((v for v in arguments.values() if torch.is_tensor(v) and v.dim() >= 2), None)
    if first is None:
        raise ValueError("ContextParallel splits a (batch, tokens) argument, and the call has none")
    return first.shape[1]
