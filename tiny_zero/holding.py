"""Helpers that lay out what a rank holds, when wrapping, used by some
strategies only: parameters' values (value, set_data, flatten, keep_whole),
released parameters (released), fp32 masters (fp32_shards). Mixed into
Wrapper. (What the step does with the averaged grads in model.grads is in
step.py.)"""
import torch
import torch.distributed as dist

from . import comm
from .materialize import full_value, set_data


class Holding:
    """Wrapper's helpers for what a rank holds."""

    def value(self, name, param):
        """The full value of `param` on this rank's device: its own data, or
        the model's init for a parameter built on meta."""
        return full_value(self.module, name, param, self.device)

    def set_data(self, param, value):
        """Point param at value, when wrapping (see tiny_zero/materialize.py:
        meta parameters too, whose swapped contents come with a new version
        counter: what adopt_param_writes compares with is read again)."""
        set_data(param, value)
        self.versions[self.position[param]] = param._version

    def broadcast_from_first_replica(self, tensor):
        """Every replica takes the first one's values (the first rank of
        replica_group; of the world, rank 0): all start alike."""
        group = self.replica_group
        comm.broadcast(tensor, src=0 if group is None else dist.get_global_rank(group, 0), group=group)

    def broadcast_buffers(self):
        """Every replica takes the first one's buffers (BatchNorm's running
        statistics), one broadcast per dtype, as torch DDP's broadcast_buffers."""
        for same in self.buffers_to_sync:
            flat = torch._utils._flatten_dense_tensors(same)
            self.broadcast_from_first_replica(flat)
            torch._foreach_copy_(same, torch._utils._unflatten_dense_tensors(flat, same))

    def released(self, param):
        """What a parameter holds while this rank keeps none of it: its full
        shape over a single shared zero, so p.shape and p.dim() stay true (for
        param groups built after wrapping) and nothing is allocated; writing
        into it fails."""
        if param not in self.released_views:
            if self.released_zero is None:
                self.released_zero = torch.zeros((), dtype=self.param_dtype, device=self.device)
            self.released_views[param] = self.released_zero.expand(self.shapes[self.name_of[param]])
        return self.released_views[param]

    def fp32_shards(self, tensors):
        """The fp32 tensors the optimizer steps for these flat tensors of
        parameters: the tensors themselves in fp32, else fp32 masters (the
        optimizer writes the low-precision copy back in the same pass)."""
        if self.param_dtype == torch.float32:
            return list(tensors)
        masters = [t.detach().float() for t in tensors]
        self.working.update(zip(masters, tensors))
        return masters

    def flatten(self, buckets, params):
        """One flat buffer holding `params` in the buckets' layout; each
        parameter becomes a view of it. Rank 0's values, on every rank."""
        flat = torch.zeros(sum(b.numel for b in buckets), dtype=self.param_dtype, device=self.device)
        name_of = self.param_names()
        for p in params:
            bucket = next(b for b in buckets if p in b.offsets)
            view = bucket.view(flat, p)
            view.copy_(self.value(name_of[p], p))
            self.set_data(p, view)
        self.broadcast_from_first_replica(flat)
        return flat

    def keep_whole(self, params):
        """Parameters every rank keeps whole and never steps (frozen ones under
        ddp, zero1, zero2): on this device, rank 0's values."""
        name_of = self.param_names()
        for p in params:
            value = self.value(name_of[p], p)
            self.broadcast_from_first_replica(value)
            self.set_data(p, value)


class HeldInChunks:
    """grad_attr, pieces and full_values of a strategy whose every rank holds
    the N-th chunk of each bucket as model.shards[bucket.index] (zero1, zero2,
    offload): p.grad a ShardedGrad, the pieces and the full values the chunks'."""

    def grad_attr(self, param):
        return self.sharded_grad(param)

    def pieces(self):
        return self.chunk_pieces()

    def full_values(self):
        return self.full_values_of_chunks()
