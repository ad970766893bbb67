"""State dicts of a wrapped model and of its optimizer, and the one path
for loading values into a wrapper (load_pieces): what torch users call on a
model and an optimizer, kept apart from one training step's code.

    model.state_dict()       full fp32 values on every rank, keys as torch DDP's ("module.x")
    model.load_state_dict()  restores every shard, the fp32 masters and the buffers
    model.module.load_state_dict(), and a submodule's: the same (guard_module_state_dicts)
    model.full_state_dict()  the same values, keys as the module's own
    model.load_pieces(read)  each rank reads only what it holds (checkpoints, pretrained weights)
    opt.state_dict()         this rank's shard of the optimizer state, marked with the strategy,
                             rank and world size that made it: it loads only there
"""
import functools

import torch
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys


class WrapperStateDicts:
    """Mixed into Wrapper."""

    def full_state_dict(self):
        """Full fp32 values (the masters), keys as module.state_dict(), on every rank."""
        full = self.gather_full()
        return {k: full[v] if v in full else v.detach().float().cpu().clone()
                for k, v in self.module.state_dict(keep_vars=True).items()}

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """Full fp32 values on every rank, keys as torch DDP's ("module.x");
        a collective where parameters are sharded: call it on every rank."""
        out = {} if destination is None else destination
        for key, value in self.full_state_dict().items():
            out[prefix + "module." + key] = value
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Load a state dict keyed as state_dict() gives it ("module.x"; plain
        module keys too): every rank's pieces, the masters and the buffers."""
        values = {k.removeprefix("module."): v for k, v in state_dict.items()}
        missing, unexpected = self.load_subtree(values, strict, type(self).__name__)
        return _IncompatibleKeys(["module." + k for k in missing], ["module." + k for k in unexpected])

    @torch.no_grad()
    def load_subtree(self, values, strict, who, prefix=""):
        """Load `values`, keyed as the module's state_dict() keys below `prefix`
        with the prefix taken off. Returns (missing, unexpected) keys, so keyed."""
        own = {k.removeprefix(prefix): v for k, v in self.module.state_dict(keep_vars=True).items()
               if k.startswith(prefix)}
        missing = [k for k in own if k not in values]
        unexpected = [k for k in values if k not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {who}: missing keys {missing}, "
                               f"unexpected keys {unexpected}")
        names = [(key.removeprefix(prefix), name) for key, name in state_dict_names(self.module)
                 if key.startswith(prefix)]
        for key, name in names:
            if key in values and name is not None and tuple(values[key].shape) != tuple(self.shapes[name]):
                raise RuntimeError(f"size mismatch for {key}: {tuple(values[key].shape)} in the state dict, "
                                   f"{tuple(self.shapes[name])} in the model")
        by_name = {name: values[key] for key, name in names if key in values and name}
        self.load_pieces(lambda piece: by_name[piece.name].reshape(-1)[piece.lo:piece.hi].float(),
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
        between steps (module_values_whole False), raises instead of returning
        those; model.state_dict() gathers them."""
        for path, sub in self.module.named_modules():
            prefix = path + "." if path else ""
            sub.__dict__["load_state_dict"] = functools.partial(self.load_module_state_dict, sub, prefix)
            if not self.module_values_whole:
                sub.register_state_dict_pre_hook(self.refuse_module_state_dict)

    def load_module_state_dict(self, sub, prefix, state_dict, strict=True, assign=False):
        """model.module(.sub).load_state_dict(state_dict): a collective, as
        model.load_state_dict. `assign` is accepted and has no effect: the
        values are copied into what each rank holds."""
        return _IncompatibleKeys(*self.load_subtree(dict(state_dict), strict, type(sub).__name__, prefix))

    def refuse_module_state_dict(self, sub, prefix, keep_vars):
        if keep_vars:  # the Parameter objects themselves: what tiny_zero reads internally
            return
        raise RuntimeError(f"{type(self).__name__}: the module's parameters hold only this rank's part between "
                           f"steps, so {type(sub).__name__}.state_dict() would return that, not their values. "
                           "Call model.state_dict() (keys 'module.x') or model.full_state_dict() (the module's "
                           "keys) on every rank: full fp32 values, a collective; or tiny_zero.checkpoint.save")

    @torch.no_grad()
    def load_pieces(self, read, names=None):
        """Set every parameter this rank holds (or those in `names`) from
        read(piece): the fp32 values of elements [piece.lo, piece.hi) of
        parameter piece.name, flattened (a 1-D tensor of piece.hi - piece.lo
        elements). Call it on every rank; each rank reads only what it holds.
        Checkpoints, state dicts and pretrained weights load through it."""
        for piece in self.all_pieces():
            if names is not None and piece.name not in names:
                continue
            place = slice(piece.offset, piece.offset + piece.hi - piece.lo)
            values = read(piece)
            piece.tensor[place] = values
            if piece.tensor in self.working:
                self.working[piece.tensor][place] = values
        self.sync_params()


def state_dict_names(module):
    """[(state_dict key, the parameter name it is, or None for a buffer)]: tied
    parameters appear under every key they have."""
    name_of = {p: name for name, p in module.named_parameters()}
    return [(key, name_of.get(value)) for key, value in module.state_dict(keep_vars=True).items()]


class OptimizerStateDicts:
    """Mixed into StrategyAdamW."""

    def piece_state(self, piece):
        """exp_avg, exp_avg_sq (their slices for this piece; None before the
        first step) and the step count of piece's parameter: what a checkpoint
        keeps."""
        p = dict(self.model.named_params)[piece.name]
        state = self.state.get(piece.tensor, {})
        place = slice(piece.offset, piece.offset + piece.hi - piece.lo)
        moments = [state[k][place] if k in state else None for k in ("exp_avg", "exp_avg_sq")]
        return moments[0], moments[1], float(self.state[p]["step"]) if "step" in self.state.get(p, {}) else 0.0

    def load_piece_state(self, piece, exp_avg, exp_avg_sq, step):
        p = dict(self.model.named_params)[piece.name]
        place = slice(piece.offset, piece.offset + piece.hi - piece.lo)
        m, v = self.moments(piece.tensor)
        m[place], v[place] = exp_avg, exp_avg_sq
        self.step_count(p).fill_(step)

    def state_dict(self):
        """This rank's state (its shards' moments, the step counts) and the
        param groups, marked with the strategy, rank and world size that made
        it: it loads only there (tiny_zero.checkpoint saves and loads across
        strategies and world sizes)."""
        model = self.model
        names = model.param_names()
        shard_index = {id(s): i for i, s in enumerate(model.shards)}
        state = {}
        for key, value in self.state.items():
            if id(key) in shard_index:
                state[f"shard{shard_index[id(key)]}"] = {k: v.clone() for k, v in value.items()}
            elif key in names:
                state[names[key]] = {k: v.clone() for k, v in value.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": state, "param_groups": groups, "skipped_steps": self.skipped_steps,
                "made_by": self.made_by()}

    def made_by(self):
        """Where this state belongs. Under ddp every rank's is the same, so any
        rank's loads anywhere in the world (rank None), as with torch DDP."""
        model = self.model
        return {"strategy": type(model).__name__, "rank": None if model.grads_replicated else model.rank,
                "world_size": model.world_size, "shards": [tuple(s.shape) for s in model.shards]}

    def load_state_dict(self, state_dict):
        made_by = state_dict.get("made_by")
        if made_by != self.made_by():
            raise ValueError(
                f"this optimizer state was saved by {_describe(made_by)}; this is {_describe(self.made_by())}. "
                "Each rank must load its own state_dict into the same strategy and world size; "
                "tiny_zero.checkpoint.save/load move state across strategies and world sizes")
        model = self.model
        by_name = dict(model.named_params)
        for key, value in state_dict["state"].items():
            target = model.shards[int(key[5:])] if key.startswith("shard") else by_name[key]
            self.state[target] = {k: v.to(target.device if k != "step" else "cpu").clone() for k, v in value.items()}
        groups = []
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            groups.append({**saved, "params": group["params"]})
        self.param_groups = groups
        self.skipped_steps = state_dict.get("skipped_steps", 0)


def _describe(made_by):
    if not made_by:
        return "something other than a tiny_zero strategy optimizer"
    rank = "every rank" if made_by["rank"] is None else f"rank {made_by['rank']}"
    return f"{rank} of {made_by['world_size']} under {made_by['strategy']}"
