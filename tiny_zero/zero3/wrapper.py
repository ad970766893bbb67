"""ZeRO-3, inter-tensor: each whole parameter tensor is owned by one rank.

A rank holds: the tensors it owns (owner_table below: largest first, each to
the least-loaded rank, the same on every rank, computed without
communication), the trainable ones in one flat buffer (owned), with their
averaged grads and optimizer state; per unit (a transformer block by default;
`units=` picks module classes or names) a buffer for the others' tensors,
whose memory exists only while the unit's layers run (and the next unit's,
gathered ahead). At world 1 a rank owns all: nothing is gathered or sent.
Collectives: broadcast of a unit's tensors from each owner, all at once (its
bucket: its tensors of the unit, side by side), before the unit's first layer
runs forward and again before its last layer's backward, the next unit's
started ahead (layers.py: before_layer); reduce of each bucket's grads to its
owner in backward, as soon as they are final. Owners step their tensors:
nothing is gathered after.
"""
import torch

from .. import comm, holding
from ..buckets import DEFAULT_BUCKET_BYTES, Buckets, buckets_from_runs
from ..step import Wrapper
from ..units import Unsharding, find_units
from .layers import LAYER_CLASSES


class Zero3(Unsharding, Wrapper):
    layer_classes = LAYER_CLASSES
    params_whole_between_steps = False  # the parameters: released between uses

    def __init__(self, module, bucket_bytes=DEFAULT_BUCKET_BYTES, units=None, **options):
        super().__init__(module, **options)  # options: mixed_precision, reduce_dtype, loss_scaler, device
        table = owner_table([(n, p.numel()) for n, p in self.named_params], self.world_size)
        self.owner = {p: table[name] for name, p in self.named_params}  # STRATEGY: whole tensors, one owner each
        layers = self.strategy_layers  # tiny_zero's layers and the hooked modules (hooked.py)
        groups = find_units(self.module, layers, units)
        self.unit_params = unit_params(groups)
        unit_of = {p: unit for unit, params in self.unit_params.items() for p in params}
        buckets = owner_buckets(self.trainable[::-1], self.owner, unit_of, bucket_bytes)  # grad-ready order
        self.owned_buckets = [b for b in buckets if self.owner[b.params[0]] == self.rank]
        self.owned = self.keep_owned(self.owned_buckets)
        self.buckets = Buckets(buckets, self.reduce_dtype, self.device,
                               average_over=self.world_size)  # STRATEGY: each bucket / N, as it is flattened to be sent
        self.index_params(self.buckets)  # each trainable parameter's place in them (wrapping.py)
        self.shards = holding.fp32_shards(self, [self.owned]) if self.owned.numel() else []
        self.unit_buckets = {unit: [b for b in buckets if unit_of[b.params[0]] == unit] for unit in self.unit_params}
        self.units_of = {m: list(dict.fromkeys(unit_of[p] for p in m.parameters(recurse=False))) for m in layers}
        self.releases_params = self.world_size > 1  # world 1: this rank owns every tensor
        self.unit_buffer, self.broadcasts, self.views = {}, {}, {}  # per unit: see make_buffer
        for unit in self.unit_params if self.releases_params else ():
            self.make_buffer(unit)
        self.start_gathering(self.units_of, groups, self.unit_params, self.unit_params.get)
        self.unfinished = []  # (bucket, its reduce, None, the sum) in flight

    def keep_owned(self, owned_buckets):
        """Owners keep (or materialise from meta) their tensors, the trainable
        ones in one flat buffer in bucket order; everyone else keeps nothing.
        The values are rank 0's (or the model's init, the same everywhere)."""
        owned = torch.zeros(sum(b.numel for b in owned_buckets), dtype=self.param_dtype, device=self.device)
        self.owned_start, start = {}, 0
        for b in owned_buckets:
            self.owned_start[b], start = start, start + b.numel
        for name, p in self.named_params:
            if p.is_meta and self.owner[p] != self.rank:
                holding.set_data(self, p, holding.released(self, p))  # built on meta: only the owner makes the value
                continue
            value = holding.full_value(self, name, p)
            if not p.is_meta:
                comm.broadcast(value, src=0)
            if self.owner[p] != self.rank:
                holding.set_data(self, p, holding.released(self, p))
            elif p.requires_grad:
                bucket = next(b for b in owned_buckets if p in b.offsets)
                view = bucket.own_view(owned[self.owned_start[bucket]:], p)
                view.copy_(value)
                holding.set_data(self, p, view)
            else:
                holding.set_data(self, p, value)
            del value  # one full tensor at a time
        return owned

    def make_buffer(self, unit):
        """Once per unit: unit_buffer, the others' tensors of the unit side by side (its memory let go until
        gathered); broadcasts, [(what a broadcast fills or sends, its owner)], per bucket and frozen tensor;
        views, [(p, its view of unit_buffer, released)]."""
        frozen = buckets_from_runs([[p] for p in self.unit_params[unit] if p not in self.buckets.of])
        parts = [(b, self.owner[b.params[0]]) for b in self.unit_buckets[unit] + frozen]
        buffer = torch.empty(sum(b.numel for b, owner in parts if owner != self.rank), dtype=self.param_dtype,
                             device=self.device)
        broadcasts, views, start = [], [], 0
        for bucket, owner in parts:
            at = self.owned_start.get(bucket)  # sent from where it is kept: the owned buffer, or the frozen tensor
            if owner == self.rank:
                flat = bucket.params[0].data if at is None else self.owned[at:at + bucket.numel]
            else:
                flat, start = buffer[start:start + bucket.numel], start + bucket.numel
                views += [(p, bucket.own_view(flat, p), holding.released(self, p)) for p in bucket.params]
            broadcasts.append((flat, owner))
        buffer.untyped_storage().resize_(0)
        self.unit_buffer[unit], self.broadcasts[unit], self.views[unit] = buffer, broadcasts, views

    # ------------------------------------------------------------ gather (when: units.Unsharding)

    def start_gather(self, unit):
        """Start a unit's broadcasts, into its buffer, grown back to full size."""
        buffer = self.unit_buffer[unit]
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())  # STRATEGY: memory for others' tensors
        return buffer, [comm.broadcast(flat, src=owner, async_op=True)  # STRATEGY: owner -> all, each bucket at once
                        for flat, owner in self.broadcasts[unit]]

    # ------------------------------------------------------------ grads

    @torch.no_grad()
    def send_bucket(self, bucket):
        """Send a bucket whose grads are final to its owner."""
        owner = self.owner[bucket.params[0]]
        handle = comm.reduce(bucket.grads, dst=owner, async_op=True) if self.releases_params else None  # STRATEGY: sum
        self.queue_finish(bucket, handle, None, bucket.grads)  # at the owner (world 1: the bucket is the sum, here)

    def finish(self, bucket, handle, dest, out):
        """dest is None: the owner finds its place in model.grads once the sum is there (made at the first finish)."""
        if handle is not None:
            handle.wait()
        if bucket in self.owned_start:  # STRATEGY: the owner keeps the average; the others drop the bucket
            start = self.owned_start[bucket]
            self.add_to_grads(self.grads_for(self.shards[0])[start:start + bucket.numel], out)
        bucket.grads = None  # STRATEGY: free the bucket's full grads

    after_backward = Wrapper.finish_sends

    def sync_params(self):
        pass  # the owners hold the updated tensors; the next forward broadcasts them

    # ------------------------------------------------------------ zero_grad, p.grad, state dicts (torch's conventions)

    def clear_grads(self, set_to_none):
        self.drop_grads(set_to_none)

    def grad_attr(self, param):
        return self.sharded_grad(param)

    def pieces(self):
        owned = [piece for b in self.owned_buckets
                 for piece in holding.bucket_pieces(self, b, 0, b.numel, self.shards[0], self.owned_start[b])]
        frozen = [p for p in self.frozen if self.owner[p] == self.rank]
        return owned + holding.whole_pieces(self, frozen, replicated=False)

    @torch.no_grad()
    def full_values(self):
        values = {piece.name: piece.tensor[piece.offset:piece.offset + piece.hi] for piece in self.pieces()}
        full = {}
        for name, p in self.named_params:
            owns = self.owner[p] == self.rank
            value = values[name].float().view(self.shapes[name]) if owns else torch.empty(self.shapes[name])
            value = value.to(self.device)
            comm.broadcast(value, src=self.owner[p])  # the fp32 master, from its owner
            full[p] = value.cpu().clone()
        return full


def unit_params(groups):
    """{unit: its parameters} for groups of layers (a block, or one layer): a
    tied parameter belongs to the first unit that has it."""
    seen, out = set(), {}
    for unit, layers in groups:
        own = list(dict.fromkeys(p for layer in layers for p in layer.parameters(recurse=False) if p not in seen))
        seen.update(own)
        if own:
            out[unit] = own
    return out


def owner_buckets(params, owner, unit_of, bucket_bytes):
    """Buckets of grads bound for one owner each, of one unit, at most
    bucket_bytes, ordered by when their last grad becomes ready. A bucket
    holds one unit's grads alone, so it is final by the end of that unit's
    backward (as FSDP2's reduce-scatter of one unit)."""
    runs, open_runs, size, last = [], {}, {}, {}
    for position, p in enumerate(params):
        rank, nbytes = owner[p], p.numel() * p.element_size()
        run = open_runs.setdefault(rank, [])
        if run and (size[rank] + nbytes > bucket_bytes or unit_of[run[0]] != unit_of[p]):
            runs.append((last[rank], run))  # ordered by its own last grad
            run = open_runs[rank] = []
        if not run:
            size[rank] = 0
        run.append(p)
        size[rank] += nbytes
        last[rank] = position
    runs += [(last[r], run) for r, run in open_runs.items() if run]
    runs.sort(key=lambda item: item[0])
    return buckets_from_runs([run for _, run in runs])


def owner_table(named_shapes, world_size):
    """{name: rank} for [(name, numel), ...], balanced by numel: largest first,
    each to the least-loaded rank (ties to the lower rank, names break size ties)."""
    load, owner = [0] * world_size, {}
    for name, numel in sorted(named_shapes, key=lambda item: (-item[1], item[0])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += numel
    return owner


def loads(owner, named_shapes, world_size):
    """Elements owned by each rank."""
    load = [0] * world_size
    for name, numel in named_shapes:
        load[owner[name]] += numel
    return load
