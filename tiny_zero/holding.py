"""What a rank holds: plain functions of the wrapper (`model`) that the
strategies call (holding.name(self, ...)). When wrapping: parameters'
values (full_value, set_data, flatten_params, keep_whole), released
parameters (released), fp32 masters (fp32_shards). For state dicts and
checkpoints, the pieces a rank holds (bucket_pieces, whole_pieces) and the
full values of a bucket held in chunks (full_values_of_bucket). And
HeldInChunks, mixed into the strategies whose every rank holds chunks of
buckets. (What the step does with the averaged grads in model.grads is in
step.py.)"""
import torch
import torch.distributed as dist

from . import comm, materialize
from .state_dicts import Piece


def full_value(model, name, param):
    """The full value of `param` on this rank's device: its own data, or
    the model's init for a parameter built on meta."""
    return materialize.full_value(model.module, name, param, model.device)


def set_data(model, param, value):
    """Point param at value, when wrapping (see tiny_zero/materialize.py:
    meta parameters too, whose swapped contents come with a new version
    counter: what adopt_param_writes compares with is read again)."""
    materialize.set_data(param, value)
    model.state_dicts.versions[model.position[param]] = param._version


def broadcast_from_first_replica(model, tensor):
    """Every replica takes the first one's values (the first rank of
    replica_group; of the world, rank 0): all start alike."""
    group = model.replica_group
    comm.broadcast(tensor, src=0 if group is None else dist.get_global_rank(group, 0), group=group)


def broadcast_buffers(model):
    """Every replica takes the first one's buffers (BatchNorm's running
    statistics), one broadcast per dtype, as torch DDP's broadcast_buffers."""
    for same in model.buffers_to_sync:
        flat = torch._utils._flatten_dense_tensors(same)
        broadcast_from_first_replica(model, flat)
        torch._foreach_copy_(same, torch._utils._unflatten_dense_tensors(flat, same))


def released(model, param):
    """What a parameter holds while this rank keeps none of it: its full
    shape over a single shared zero, so p.shape and p.dim() stay true (for
    param groups built after wrapping) and nothing is allocated; writing
    into it fails."""
    if param not in model.released_views:
        if model.released_zero is None:
            model.released_zero = torch.zeros((), dtype=model.param_dtype, device=model.device)
        model.released_views[param] = model.released_zero.expand(model.shapes[model.name_of[param]])
    return model.released_views[param]


def fp32_shards(model, tensors):
    """The fp32 tensors the optimizer steps for these flat tensors of
    parameters: the tensors themselves in fp32, else fp32 masters (the
    optimizer writes the low-precision copy back in the same pass)."""
    if model.param_dtype == torch.float32:
        return list(tensors)
    masters = [t.detach().float() for t in tensors]
    model.working.update(zip(masters, tensors))
    return masters


def flatten_params(model, buckets, params):
    """One flat buffer holding `params` in the buckets' layout; each
    parameter becomes a view of it. Rank 0's values, on every rank."""
    flat = torch.zeros(sum(b.numel for b in buckets), dtype=model.param_dtype, device=model.device)
    for p in params:
        bucket = next(b for b in buckets if p in b.offsets)
        view = bucket.view(flat, p)
        view.copy_(full_value(model, model.name_of[p], p))
        set_data(model, p, view)
    broadcast_from_first_replica(model, flat)
    return flat


def keep_whole(model, params):
    """Parameters every rank keeps whole and never steps (frozen ones under
    ddp, zero1, zero2): on this device, rank 0's values."""
    for p in params:
        value = full_value(model, model.name_of[p], p)
        broadcast_from_first_replica(model, value)
        set_data(model, p, value)


def bucket_pieces(model, bucket, begin, n, tensor, offset=0):
    """Pieces of the parameters of `bucket` (a flat layout) whose elements
    fall in [begin, begin + n) of it, held at tensor[offset:offset + n]."""
    pieces = []
    for p in bucket.params:
        start = bucket.offsets[p]
        lo, hi = max(start, begin), min(start + bucket.shapes[p].numel(), begin + n)
        if lo < hi:
            pieces.append(Piece(model.name_of[p], bucket.shapes[p], lo - start, hi - start, tensor,
                                offset + lo - begin, False))
    return pieces


def whole_pieces(model, params, replicated=True):
    """Pieces of parameters held whole, in their own storage (by every
    rank, or, not replicated, by this one)."""
    return [Piece(model.name_of[p], p.shape, 0, p.numel(), p.data.view(-1), 0, replicated) for p in params]


def full_values_of_bucket(model, bucket, chunk):
    """{parameter: full fp32 value on the CPU} for a bucket of which every
    rank holds a 1/N chunk (fp32): one all_gather."""
    flat = torch.empty(bucket.numel, dtype=torch.float32, device=model.device)
    comm.all_gather(flat, chunk.to(model.device))  # a chunk kept in host memory (offload) goes by the device
    return {p: bucket.own_view(flat, p).cpu().clone() for p in bucket.params}


class HeldInChunks:
    """grad_attr, pieces and full_values of a strategy whose every rank holds
    the N-th chunk of each bucket as model.shards[bucket.index] (zero1, zero2,
    offload), and frozen parameters whole: p.grad a ShardedGrad, the pieces
    and the full values the chunks'."""

    def grad_attr(self, param):
        return self.sharded_grad(param)

    def pieces(self):
        chunks = [piece for bucket, shard in zip(self.buckets, self.shards)
                  for piece in bucket_pieces(self, bucket, self.rank * shard.numel(), shard.numel(), shard)]
        return chunks + whole_pieces(self, self.frozen)

    def full_values(self):
        full = {p: p.detach().float().cpu().clone() for p in self.frozen}
        for bucket, shard in zip(self.buckets, self.shards):
            full.update(full_values_of_bucket(self, bucket, shard))  # the fp32 masters, not the low-precision copy
        return full
