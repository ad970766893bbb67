"""Tensor parallelism (Megatron-LM): the Linears a plan names are split across
the T ranks of a tensor group; the tensor groups are data-parallel replicas.

    TensorParallel(module, {"*.qkv": ("column", 3), "*.o": "row", "*.up": "column", "*.down": "row"}, tp_size=T)

A plan splits Linears in Megatron's pairs (check_pairs): every rank refuses
any other at wrap time, before anything is sent.

The world is T x R ranks. Ranks r*T .. r*T + T-1 are replica r's tensor group
(consecutive ranks, as Megatron keeps a tensor group inside a node): they
compute one model on replica r's batch, which each of them is given.

A rank k holds: of a "column" Linear, slice k of its output features (rows of
the weight, and of the bias); of a "row" Linear, slice k of its input features
(columns of the weight) and the whole bias; with (kind, n), the split features
are n equal parts (a fused [q; k; v] Linear: n = 3), each cut in T slices.
Every other parameter whole. The trainable ones in one flat buffer
(flat_params), their grads in another of the same layout (flat_grads), cut
into buckets, and the optimizer state of all of it: of the planned weights,
1/T. Frozen parameters in their own storage, split alike, never sent.
Collectives: at wrap time, a broadcast of each of rank 0's parameters; in a
tensor group, an all_reduce of each row Linear's output in forward and of each
column Linear's input grad in backward (layers.py); across the replicas, an
all_reduce of each bucket of grads during backward, as soon as its grads are
final, as ddp's; at the end of the backward pass, the waits and the division
by R. Nothing after the step: every rank updated what it holds, and the ranks
holding the same parameter made the same update with the same grads.
"""
from collections import Counter
from fnmatch import fnmatchcase
from math import prod

import torch
import torch.nn as nn

from .. import agreements, comm, holding
from ..buckets import DEFAULT_BUCKET_BYTES, Buckets, make_buckets
from ..distributed import init_distributed
from ..state_dicts import Piece
from ..step import Wrapper
from .layers import COLUMN_LINEAR, LAYER_CLASSES, ROW_LINEAR

SPLITS = ("column", "row")


class TensorParallel(Wrapper):
    layer_classes = LAYER_CLASSES
    params_whole_between_steps = False  # the parameters: slices

    def __init__(self, module, plan, tp_size=None, bucket_bytes=DEFAULT_BUCKET_BYTES, **options):
        rank, world_size = init_distributed()
        tp_size = world_size if tp_size is None else tp_size
        planned = planned_linears(module, plan, tp_size, world_size)  # every rank raises alike, before any collective
        super().__init__(module, **options)  # options: mixed_precision, reduce_dtype, loss_scaler, device
        self.plan, self.tp_size, self.tp_rank = dict(plan), tp_size, rank % tp_size
        self.replica, self.replicas = rank // tp_size, world_size // tp_size
        self.tensor_group, self.replica_group = process_groups(tp_size, self.replicas)
        self.column_input = None  # (x, x through SumOverSlices) for the column Linears reading x, in one forward
        self.split = split_parameters(planned)  # parameter -> (dim, parts)
        for layer, (kind, _) in planned.items():
            layer.__class__ = COLUMN_LINEAR if kind == "column" else ROW_LINEAR
            if kind == "column":
                layer.out_features //= tp_size  # the Linear this rank computes
            else:
                layer.in_features //= tp_size
        self.keep_parts()
        buckets = make_buckets(self.trainable[::-1], bucket_bytes)  # backward runs the last layer first
        self.flat_params = self.flatten_parts(buckets)
        self.flat_grads = torch.zeros_like(self.flat_params, dtype=self.reduce_dtype)
        self.buckets = Buckets(buckets, self.reduce_dtype, self.device, flat=self.flat_grads,
                               average_over=self.replicas)  # STRATEGY: each bucket / R, before it is sent
        self.index_params(self.buckets)  # each trainable parameter's place in them (wrapping.py)
        self.shards = holding.fp32_shards(self, [self.flat_params])
        self.grads = {self.shards[0]: self.flat_grads}

    def forward(self, *args, **kwargs):
        self.column_input = None  # held only within a forward: it keeps its x alive
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.column_input = None

    # ------------------------------------------------------------ what a rank holds

    def keep_parts(self):
        """Every parameter from rank 0, one full tensor at a time: this rank's
        slice of a planned one, the whole of any other."""
        for name, p in self.named_params:
            value = holding.full_value(self, name, p)
            if not p.is_meta:
                comm.broadcast(value, src=0)  # every rank starts from rank 0's weights
            holding.set_data(self, p, self.my_slice(p, value) if p in self.split else value)

    def my_slice(self, p, full):
        dim, parts = self.split[p]
        shape = full.shape
        mine = full.view(cut(shape, dim, parts, self.tp_size)).select(dim + 1, self.tp_rank)  # STRATEGY: slice k of each part
        local = torch.empty((*shape[:dim], shape[dim] // self.tp_size, *shape[dim + 1:]), dtype=full.dtype,
                            device=full.device)
        local.view(mine.shape).copy_(mine)
        return local

    def flatten_parts(self, buckets):
        """One flat buffer of the trainable parameters (this rank's slices and
        the whole ones) in the buckets' layout; each becomes a view of it."""
        flat = torch.zeros(sum(b.numel for b in buckets), dtype=self.param_dtype, device=self.device)
        for bucket in buckets:
            for p in bucket.params:
                view = bucket.view(flat, p)
                view.copy_(p.data)
                holding.set_data(self, p, view)
        return flat

    def storage(self, p):
        """(a flat tensor, where p starts in it): the optimizer's shard for a
        trainable parameter, a frozen one's own storage."""
        if p in self.buckets.of:  # trainable when wrapped
            bucket = self.buckets.of[p]
            return self.shards[0], bucket.start + bucket.offsets[p]
        return p.data.view(-1), 0

    # ------------------------------------------------------------ grads

    def all_reduce(self, bucket):
        if self.replicas > 1:
            bucket.handle = comm.all_reduce(bucket.grads, async_op=True, group=self.replica_group)  # STRATEGY: the replicas' sum

    @torch.no_grad()
    def after_backward(self):
        for bucket in self.buckets.unsent():  # what backward did not send: parameters used no more
            self.all_reduce(bucket)
        # grads averaged before (no zero_grad) were the same on every replica: / R, summed, they stay
        self.buckets.wait()  # STRATEGY: the only wait, at the end of backward

    def clear_grads(self, set_to_none):
        pass  # the buckets are views of flat_grads, which Buckets.clear zeroes

    def grad_attr(self, param):
        if param in self.split or self.reduce_dtype != param.dtype:  # a slice, or not the parameter's dtype
            return self.sharded_grad(param)
        return self.buckets.of[param].view(self.flat_grads, param)

    @torch.no_grad()
    def grad_square_sum(self):
        """Each slice counted once (a sum over the tensor group), each whole
        parameter once (every rank of the group holds the same grad)."""
        sliced = torch.zeros((), dtype=torch.float32, device=self.device)
        whole = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in self.trainable:
            grad = self.buckets.of[p].view(self.flat_grads, p).float()
            (sliced if p in self.split else whole).add_(grad.square().sum())
        comm.all_reduce(sliced, group=self.tensor_group)
        return sliced + whole

    # ------------------------------------------------------------ pieces, full values

    def pieces(self):
        """A whole parameter is one piece; a slice is one piece per stretch of
        the flattened full tensor it covers: one per part of a column split,
        one per row of the weight of a row split."""
        pieces = []
        for name, p in self.named_params:
            tensor, start = self.storage(p)
            if p not in self.split:
                pieces.append(Piece(name, p.shape, 0, p.numel(), tensor, start, True))
                continue
            dim, parts = self.split[p]
            shape = self.shapes[name]
            stretch = shape[dim] // (parts * self.tp_size) * prod(shape[dim + 1:])
            for i in range(prod(shape[:dim]) * parts):  # the stretches of the full tensor, in order
                lo = (i * self.tp_size + self.tp_rank) * stretch
                pieces.append(Piece(name, shape, lo, lo + stretch, tensor, start + i * stretch, True))
        return pieces

    def pieces_to_save(self):
        """A slice is held by every replica, a whole parameter by every rank:
        each is written by one of the ranks that hold it."""
        split = {self.name_of[p] for p in self.split}
        pieces = self.pieces()
        sliced = [p for p in pieces if p.name in split]
        whole = [p for p in pieces if p.name not in split]
        return sliced[self.replica::self.replicas] + whole[self.rank::self.world_size]

    @torch.no_grad()
    def full_values(self):
        full = {}
        for name, p in self.named_params:
            tensor, start = self.storage(p)
            mine = tensor[start:start + p.numel()].float()  # the fp32 master, not the low-precision copy
            if p in self.split:
                gathered = torch.empty(self.tp_size * p.numel(), dtype=torch.float32, device=self.device)
                comm.all_gather(gathered, mine, group=self.tensor_group)
                mine = self.join_slices(p, gathered)
            full[p] = mine.view(self.shapes[name]).cpu().clone()
        return full

    def join_slices(self, p, gathered):
        """The full tensor from every rank's slice of it, rank after rank."""
        dim, parts = self.split[p]
        shape = self.shapes[self.name_of[p]]
        sliced = cut(shape, dim, parts, self.tp_size)
        by_rank = gathered.view(self.tp_size, *sliced[:dim + 1], *sliced[dim + 2:])  # (T, ..., parts, size, ...)
        return by_rank.movedim(0, dim + 1).reshape(shape)  # (..., parts, T, size, ...): slice k of each part

    def sync_params(self):
        pass  # every rank made the update of what it holds: nothing to send


def cut(shape, dim, parts, tp_size):
    """shape, with dimension `dim` seen as (parts, T, size): slice k of each part is [:, k]."""
    return (*shape[:dim], parts, tp_size, shape[dim] // (parts * tp_size), *shape[dim + 1:])


def process_groups(tp_size, replicas):
    """This rank's tensor group (consecutive ranks) and replica group (the
    ranks that hold the same slices: every T-th). Collective: every rank
    makes every group, in the same order."""
    tensor_groups = [agreements.new_group(range(r * tp_size, (r + 1) * tp_size)) for r in range(replicas)]
    replica_groups = [agreements.new_group(range(k, tp_size * replicas, tp_size)) for k in range(tp_size)]
    tensor_group = next(g for g in tensor_groups if g is not None)  # new_group: None where this rank is not in it
    replica_group = next(g for g in replica_groups if g is not None)
    return tensor_group, replica_group


def planned_linears(module, plan, tp_size, world_size):
    """{layer: (kind, parts)} for the Linears the plan names (fnmatch patterns
    over module names), checked to be Megatron's pairs (check_pairs). Local
    checks only, so that every rank raises the same error before anything is
    sent."""
    if not isinstance(plan, dict):
        raise TypeError(f"plan must be a dict of module-name patterns to 'column' or 'row', got {type(plan).__name__}")
    if not isinstance(tp_size, int) or tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tp_size={tp_size!r} must divide the world size {world_size} (world = tp_size x replicas)")
    uses = Counter(p for layer in module.modules() for p in layer.parameters(recurse=False))
    planned = {}
    for pattern, how in plan.items():
        kind, parts = how if isinstance(how, tuple) and len(how) == 2 else (how, 1)
        if kind not in SPLITS or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"plan[{pattern!r}] = {how!r}: give 'column', 'row', or (one of them, parts) for a "
                             "Linear that fuses equal parts, such as ('column', 3) for a fused [q; k; v]")
        matched = [(name, layer) for name, layer in module.named_modules() if fnmatchcase(name, pattern)]
        if not matched:
            linears = [name for name, layer in module.named_modules() if isinstance(layer, nn.Linear)]
            raise ValueError(f"plan pattern {pattern!r} matches no module; the Linears are named "
                             f"{', '.join(linears[:4]) or '(none)'}{', ...' if len(linears) > 4 else ''}")
        for name, layer in matched:
            check_split(name, layer, pattern, kind, parts, tp_size, uses)
            if planned.setdefault(layer, (kind, parts)) != (kind, parts):
                raise ValueError(f"{name} is matched by two patterns of the plan with different splits: "
                                 f"{planned[layer]} and {(kind, parts)}")
    check_pairs(module, planned, tp_size)
    return planned


def split_parameters(planned):
    """{parameter: (dim, parts)}: where each split parameter is cut (a column
    Linear's weight and bias by rows, dim 0; a row Linear's weight by
    columns, dim 1), and in how many equal parts first."""
    split = {}
    for layer, (kind, parts) in planned.items():
        split[layer.weight] = (0 if kind == "column" else 1, parts)
        if kind == "column" and layer.bias is not None:
            split[layer.bias] = (0, parts)
    return split


def check_split(name, layer, pattern, kind, parts, tp_size, uses):
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"plan pattern {pattern!r} matches {name} ({type(layer).__name__}): "
                        "only nn.Linear layers are split; leave the others out of the plan")
    features, which = (layer.out_features, "output") if kind == "column" else (layer.in_features, "input")
    if features % (parts * tp_size):
        raise ValueError(f"{name}: a {kind} split cuts its {features} {which} features into {parts} part(s) of "
                         f"tp_size={tp_size} slices, and {features} is not a multiple of {parts * tp_size}")
    if any(uses[p] > 1 for p in layer.parameters(recurse=False)):
        raise ValueError(f"{name} shares a parameter with another layer (tied weights): a split parameter "
                         "cannot be shared; leave it out of the plan")


HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head", "num_key_value_heads", "n_kv_head")


def check_pairs(module, planned, tp_size):
    """A plan computes the unsplit model's function only in Megatron's pairs
    (docs/tensor.md, "What a plan must be"): in every module that holds a
    split Linear, every Linear is split, column ones before the row one that
    takes their output; an attention's heads divide by tp_size, and nothing
    else in it holds parameters. It reads the module tree only, so every
    rank decides alike."""
    if module in planned:
        raise ValueError("the plan splits the wrapped module itself: a column split would return each rank's "
                         "slice of the output, a row split would take a whole input; split the Linears inside it")
    for where, parent in module.named_modules():
        linears = [(child_name(where, name), child) for name, child in parent.named_children()
                   if isinstance(child, nn.Linear)]
        kinds = [planned[layer][0] if layer in planned else None for _, layer in linears]
        if any(kinds):
            check_attention(where, parent, tp_size)
            check_order(where, [name for name, _ in linears], kinds)


def check_order(where, names, kinds):
    """The Linears of one module (names, in the order it registers them; kinds:
    "column", "row" or None for whole) read as Megatron's pairs: one or more
    column Linears (q, k and v, reading one input), then the row Linear that
    takes their output slices (o)."""
    split = ", ".join(f"{name.rpartition('.')[2]} ({kind})" for name, kind in zip(names, kinds) if kind)
    columns = []  # the column Linears that no row Linear has taken the output of yet
    for i, (name, kind) in enumerate(zip(names, kinds)):
        if kind is None:
            want = "row" if columns and "row" not in kinds[i:] else "column"
            raise ValueError(f"{name} is whole, but {describe(where)} splits {split}: the Linears of one module "
                             "are split together, alike where they read one input (q, k and v by column, o by "
                             f"row). Add {name!r}: {want!r} to the plan, or leave them all whole")
        if kind == "row" and not columns:
            raise ValueError(f"{name} is split by row, but no column Linear comes before it in {describe(where)} "
                             f"({split}): a row split takes a column split's output slice as its input. Split "
                             f"the Linear that feeds {name} by 'column', or leave {name} whole")
        columns = columns + [name] if kind == "column" else []
    if columns:
        reaches = (f": {columns[-1]}'s output is the model's output, and a rank would return (and take a loss "
                   "over) its own slice of it" if not where else "")
        raise ValueError(f"{' and '.join(columns)} split by column, but no row Linear follows in {describe(where)} "
                         f"to take the output slice{reaches}. Leave {' and '.join(columns)} whole, or split the "
                         "Linear that reads the output by 'row'")


def check_attention(where, attention, tp_size):
    """A rank computes whole heads: the head counts an attention module names
    (itself, or in its Hugging Face config) divide by tp_size, and no other
    layer of it holds parameters (Qwen3's q_norm), whose grads would come
    from this rank's heads only."""
    if not hasattr(attention, "head_dim") and not any(hasattr(attention, a) for a in HEAD_COUNTS):
        return  # not an attention module, or one that names no head count
    for holder in (attention, getattr(attention, "config", None)):
        for attr in HEAD_COUNTS:
            count = getattr(holder, attr, None)
            if isinstance(count, int) and count % tp_size:
                raise ValueError(f"{describe(where)} has {attr}={count}, which tp_size={tp_size} does not divide: "
                                 "a rank computes whole heads. Use a tp_size that divides every head count "
                                 f"(of queries and of keys/values), or leave {describe(where)}'s Linears whole")
    for name, child in attention.named_children():
        if not isinstance(child, nn.Linear) and next(child.parameters(), None) is not None:
            raise ValueError(f"{child_name(where, name)} ({type(child).__name__}) holds parameters inside "
                             f"{describe(where)}, whose Linears are split: it would see only this rank's heads, and "
                             f"its grads would differ between the ranks. Leave {describe(where)}'s Linears whole")


def describe(where):
    return where or "the wrapped module"


def child_name(where, name):
    return f"{where}.{name}" if where else name
