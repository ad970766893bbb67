"""State dicts of a wrapped model, and the one path
for loading values into a wrapper (load_pieces): what torch users call on a
model and an optimizer, kept apart from one training step's code (a first
reader may skip this file). Held by Wrapper as model.state_dicts (a
StateDicts); the model.<name> methods below are Wrapper's one-line
delegates to it.

    model.state_dict()       full fp32 values on every rank, keys as torch DDP's ("module.x")
    model.load_state_dict()  restores every shard, the fp32 masters and the buffers
    model.module.load_state_dict(), and a submodule's: the same (guard_module_state_dicts)
    model.full_state_dict()  the same values, keys as the module's own
    model.load_pieces(read)  each rank reads only what it holds (checkpoints, pretrained weights)

The optimizer's own state dicts are in optimizer_state_dicts.py.

Where this rank's part of each parameter lies: Piece (what the strategy's
model.pieces() lists; holding.py has the helpers that find them).
"""
import functools
from collections import namedtuple
from operator import attrgetter, itemgetter

import torch
import torch.nn as nn

from . import agreements, comm
from .module.hooks import loaded_with_hooks, unhooked_state_dict
from .precision import take_written_

# Elements [lo, hi) of parameter `name` (flattened; full shape `shape`) are
# held by this rank at tensor[offset:offset + hi - lo], where `tensor` is one
# of model.shards (1-D fp32: what the optimizer steps) or, for a frozen
# parameter, its own storage. `replicated`: every replica (model.replicas)
# holds the same piece.
Piece = namedtuple("Piece", "name shape lo hi tensor offset replicated")


class StateDicts:
    """Held by Wrapper as model.state_dicts: its state dicts, what loads
    into it, and the parameters' writes in place. What a strategy fills in
    (pieces, full_values, and its own pieces_to_save, load_pieces or state
    dicts) is the wrapper's, reached through self.model."""

    def __init__(self, model):
        self.model = model
        self.versions = param_versions(model.named_params)  # in-place writes move them (adopt_param_writes)
        self.pieces_found = None  # model.pieces(), asked once (all_pieces)

    def full_state_dict(self, prefix=""):
        """model.full_state_dict(): full fp32 values (the masters), keys as
        module.state_dict(prefix=prefix). Where every rank holds every value
        (ddp) it is local, as torch DDP's: torch's tutorial takes it on rank 0
        alone. Elsewhere a collective: every rank must call it
        (meet_for_state_dict)."""
        model = self.model
        comm.where = "full_state_dict"
        if model.grads_replicated:  # still counted at the next step, which every replica agrees on
            self.copy_param_writes(self.param_writes())
        else:
            self.meet_for_state_dict()
            self.adopt_param_writes()
        full = model.full_values()
        return {k: full[v] if v in full else v.detach().float().cpu().clone()
                for k, v in model.module.state_dict(prefix=prefix, keep_vars=True).items()}

    def state_dict(self, destination, prefix):
        """model.state_dict(): full fp32 values, keys as torch DDP's ("module.x");
        a collective where parameters are sharded: call it on every rank."""
        out = {} if destination is None else destination
        out.update(self.model.full_state_dict(prefix + "module."))
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict):
        """model.load_state_dict(): a state dict keyed as state_dict() gives it
        ("module.x"; plain module keys too): every rank's pieces, the masters
        and the buffers."""
        values = {"module." + k.removeprefix("module."): v for k, v in state_dict.items()}
        return loaded_with_hooks(self.model.module, values, "module.", strict, getattr(state_dict, "_metadata", {}),
                                 lambda below, strict: self.load_subtree(below, strict, type(self.model).__name__))

    def meet_for_state_dict(self):
        """Every rank takes the state dict, or every rank raises the same
        error, at once, naming the fix. torch DDP's tutorial takes it on rank
        0 alone, then calls dist.barrier(): so the check goes out without
        waiting, then a barrier that such a rank's barrier meets, and the check
        is settled after it. A rank that went on meets the check at its next
        backward or gather (agreements: the state dict's own error); one that
        stopped at the barrier goes on to meet it there."""
        agreements.agree(agreements.TAKING_STATE_DICT, wait=False)
        try:
            comm.barrier()
        except comm.CollectiveError:  # a rank that raised at the check, and left: its error, told here too
            agreements.check_agreements()
            raise
        agreements.check_agreements()

    @torch.no_grad()
    def load_subtree(self, values, strict, who, prefix=""):
        """Load `values`, keyed as the module's state_dict() keys below `prefix`
        with the prefix taken off. Returns (missing, unexpected) keys, so keyed."""
        module, shapes = self.model.module, self.model.shapes
        entries = unhooked_state_dict(module)  # the keys a load matches, as torch's: no state_dict hooks
        own = {k.removeprefix(prefix): v for k, v in entries.items() if k.startswith(prefix)}
        missing = [k for k in own if k not in values]
        unexpected = [k for k in values if k not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {who}: missing keys {missing}, "
                               f"unexpected keys {unexpected}")
        names = [(key.removeprefix(prefix), name) for key, name in state_dict_names(module, entries)
                 if key.startswith(prefix)]
        for key, name in names:
            if key in values and name is not None and tuple(values[key].shape) != tuple(shapes[name]):
                raise RuntimeError(f"size mismatch for {key}: {tuple(values[key].shape)} in the state dict, "
                                   f"{tuple(shapes[name])} in the model")
        by_name = {name: values[key] for key, name in names if key in values and name}
        self.model.load_pieces(lambda piece: by_name[piece.name].reshape(-1)[piece.lo:piece.hi].float(),
                               names=set(by_name))
        for key, value in own.items():
            if key in values and not isinstance(value, nn.Parameter):
                value.copy_(values[key])
        return missing, unexpected

    def guard_module_state_dicts(self):
        """What torch DDP users call on the wrapped module (model.module) and
        its submodules, made right. load_state_dict(): goes through the
        wrapper (load_subtree), so every rank's pieces and fp32 masters take
        the values; torch's own would write into parameters that the next step
        overwrites from the masters, or that hold nothing (released, sliced).
        state_dict(): where the parameters do not hold their whole values
        between steps (params_whole_between_steps False), raises instead of returning
        those; model.state_dict() gathers them."""
        for path, sub in self.model.module.named_modules():
            prefix = path + "." if path else ""
            sub.__dict__["load_state_dict"] = functools.partial(self.load_module_state_dict, sub, prefix)
            if not self.model.params_whole_between_steps:
                sub.register_state_dict_pre_hook(self.refuse_module_state_dict)

    def load_module_state_dict(self, sub, prefix, state_dict, strict=True, assign=False):
        """model.module(.sub).load_state_dict(state_dict): a collective, as
        model.load_state_dict. `assign` is accepted and has no effect: the
        values are copied into what each rank holds."""
        return loaded_with_hooks(sub, dict(state_dict), "", strict, getattr(state_dict, "_metadata", {}),
                                 lambda below, strict: self.load_subtree(below, strict, type(sub).__name__, prefix))

    def refuse_module_state_dict(self, sub, prefix, keep_vars):
        if keep_vars:  # the Parameter objects themselves: what tiny_zero reads internally
            return
        raise RuntimeError(f"{type(self.model).__name__}: the module's parameters hold only this rank's part "
                           f"between steps, so {type(sub).__name__}.state_dict() would return that, not their "
                           "values. Call model.state_dict() (keys 'module.x') or model.full_state_dict() (the "
                           "module's keys) on every rank: full fp32 values, a collective; or tiny_zero.checkpoint.save")

    @torch.no_grad()
    def load_pieces(self, read, names=None):
        """model.load_pieces(): set every parameter this rank holds (or those
        in `names`) from read(piece): the fp32 values of elements [piece.lo,
        piece.hi) of parameter piece.name, flattened (a 1-D tensor of
        piece.hi - piece.lo elements). Call it on every rank; each rank reads
        only what it holds. Checkpoints, state dicts and pretrained weights
        load through it."""
        model = self.model
        for piece in self.all_pieces():
            if names is not None and piece.name not in names:
                continue
            place = slice(piece.offset, piece.offset + piece.hi - piece.lo)
            values = read(piece)
            piece.tensor[place] = values
            if piece.tensor in model.working:
                model.working[piece.tensor][place] = values
        model.sync_params()
        self.versions = param_versions(model.named_params)  # what was written before is loaded over

    def param_writes(self):
        """{name: parameter} for those written in place since the last look
        (their version counters moved)."""
        named_params = self.model.named_params
        now = param_versions(named_params)
        if now == self.versions:  # the usual: no write, told in one pass in C
            return {}
        return {name: p for (name, p), seen, was in zip(named_params, now, self.versions) if seen != was}

    @torch.no_grad()
    def adopt_param_writes(self, written=None):
        """A write into a parameter in place (p.mul_(mask), p.clamp_(),
        nn.init.*_ after wrapping) lasts in torch. Here it lasts by itself
        where the parameter is a view of what the optimizer steps (fp32 ddp,
        zero1, zero2, tensor, pipeline; zero3's owner). Where the optimizer
        steps fp32 masters apart from the module's parameters (bf16 and fp16;
        offload), the elements the write changed go into the masters this
        rank holds, before the step would write the old values back. Where a
        rank holds only part of a parameter between steps and steps values
        apart from it (fsdp; zero3, tensor and pipeline under bf16), the write
        cannot be carried: every replica raises. Every in-place write moves the
        parameter's version counter (p._version), as autograd sees it;
        p.data.mul_() moves none and is not seen.

        written: param_writes(), already in an agreement this rank sent (the
        optimizer step's); None: found and agreed on here. Every rank agrees
        on how many it saw before any goes on to refuse_lost_writes'
        collective, which a rank that saw none would never join."""
        if written is None:
            written = self.param_writes()
            agreements.agree("the parameters written in place", group=self.model.replica_group, wait=False,
                       parameters_written_in_place=len(written))
        if not written:
            return
        self.copy_param_writes(written)
        self.versions = param_versions(self.model.named_params)

    @torch.no_grad()
    def copy_param_writes(self, written):
        """Carry the writes in `written` ({name: parameter}) into what this
        rank holds (see adopt_param_writes)."""
        working = self.model.working
        pieces = {}
        for piece in self.all_pieces():
            if piece.name in written:
                pieces.setdefault(piece.name, []).append(piece)
        apart = {name: [piece for piece in pieces.get(name, [])  # the pieces the write is not in
                        if piece.tensor.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()]
                 for name, p in written.items()}
        if not self.model.params_whole_between_steps:
            self.refuse_lost_writes([name for name, mine in apart.items() if mine])
        for name, mine in apart.items():
            values = written[name].detach().reshape(-1)
            for piece in mine:
                place = slice(piece.offset, piece.offset + piece.hi - piece.lo)
                take_written_(piece.tensor[place], values[piece.lo:piece.hi])
                if piece.tensor in working:
                    working[piece.tensor][place] = piece.tensor[place]

    def refuse_lost_writes(self, lost):
        """Raise on every replica if a write is lost on any (a rank may hold
        none of a parameter that another holds part of)."""
        count = torch.tensor([len(lost)], device=self.model.device)
        comm.all_reduce(count, group=self.model.replica_group)
        if count.item():
            where = ", ".join(lost[:3]) + (" (and more)" if len(lost) > 3 else "") if lost else \
                "a parameter another rank holds part of"
            raise RuntimeError(f"{where} was written in place after wrapping (p.mul_, p.copy_, nn.init): "
                               f"{type(self.model).__name__} steps values kept apart from the module's parameters, "
                               "so the write would be lost; set new values with model.load_state_dict (or "
                               "model.module's), before or between steps")

    def all_pieces(self):
        """model.pieces(), asked once."""
        if self.pieces_found is None:
            self.pieces_found = self.model.pieces()
        return self.pieces_found

    def pieces_to_save(self):
        """model.pieces_to_save(): the pieces this rank writes to a checkpoint,
        so that each element is written once: those it alone holds, and its
        round-robin share of those every replica holds."""
        self.adopt_param_writes()
        model = self.model
        pieces = model.pieces()
        replicated = [p for p in pieces if p.replicated]
        return [p for p in pieces if not p.replicated] + replicated[model.replica::model.replicas]


_VERSION = attrgetter("_version")


def param_versions(named_params):
    """[the version counter of each parameter of named_params], which every in-place write moves."""
    return list(map(_VERSION, map(itemgetter(1), named_params)))


def state_dict_names(module, entries=None):
    """[(state_dict key, the parameter name it is, or None for a buffer)]: tied
    parameters appear under every key they have. entries: the state dict
    (keep_vars) to name, module.state_dict()'s if None."""
    name_of = {p: name for name, p in module.named_parameters()}
    entries = module.state_dict(keep_vars=True) if entries is None else entries
    return [(key, name_of.get(value)) for key, value in entries.items()]
