"""torch's conventions for p.grad (a first reader may skip this file):
what p.grad shows, zero_grad (of all parameters or some), a p.grad set
to None or assigned by the user, grads that autograd made outside a layer,
and a grad that came on another rank only; at the optimizer step, the
parameters that step (stepping), which every rank agrees on. Held by
Wrapper as model.torch_grads."""
from itertools import compress, repeat
from operator import attrgetter, is_, is_not

import torch

from . import agreements, comm
from .buckets import ParamSet
from .guards import ShardedGrad, check_requires_grad, parameter_hash

GRAD = attrgetter("grad")  # read by map(), over many parameters in C


class TorchGrads:
    """p.grad as torch keeps it, for one wrapper (self.model), whose strategy
    fills in what p.grad shows (grad_attr) and zero_grad's clear_grads."""

    def __init__(self, model, buckets):
        self.model = model  # the wrapper
        # by a trainable parameter's index in buckets (model.buckets):
        self.shown = [None] * len(buckets.params)  # what its p.grad shows (grad_attr), made once (None: not yet)
        self.shown_whole = False  # some p.grad is a view of model.grads (all_shown)
        self.showing = ParamSet(buckets)  # the parameters whose p.grad backward_done set, until zero_grad
        self.assigned = {}  # index -> (its p.grad, version) set by the user, as a backward began

    def shown_grad(self, p):
        return self.all_shown()[self.model.buckets.index[id(p)]]

    def all_shown(self):
        """What each trainable parameter's p.grad shows once it has a grad, by
        index (shown), every entry made once."""
        shown = self.shown
        if any(map(is_, shown, repeat(None))):  # before the first backward's end only
            model = self.model
            for i, p in enumerate(model.buckets.params):
                if shown[i] is None:
                    shown[i] = model.grad_attr(p)
            self.shown_whole = not all(isinstance(g, ShardedGrad) for g in shown)
        return shown

    def grads_shown_whole(self):
        """Whether some p.grad is a view of model.grads itself (ddp; pipeline
        and tensor where the dtypes agree), which the user may edit in place."""
        self.all_shown()
        return self.shown_whole

    def show(self, got):
        """The end of a backward outside no_sync(): the parameters of `got` (a
        ParamSet) whose p.grad is None show their grads."""
        for p, shown in compress(zip(self.model.buckets.params, self.all_shown()), got.marks):
            if p.grad is None:
                p.grad = shown
        self.showing.update(got)

    def zero_grad(self, set_to_none=True, params=None):
        """As torch's: p.grad None (or zero), and the wrapper's grads with it,
        for every parameter or those in `params` (an optimizer's: others keep
        accumulating, as in torch)."""
        model = self.model
        params = [p for _, p in model.named_params] if params is None else list(params)
        if set_to_none:
            for p in params:
                p.grad = None
        else:
            for p in params:
                if p.grad is not None and not isinstance(p.grad, ShardedGrad):
                    p.grad.zero_()
        indices = set(model.buckets.indices(params))
        if len(indices) == len(self.shown):  # every trainable parameter
            model.clipping.coef = None  # nothing left to clip
            model.clear_grads(set_to_none)
            model.buckets.clear(keep_got_grad=not set_to_none)
            if set_to_none:
                self.showing.clear()
                model.grads_written.clear()
        else:
            if set_to_none:
                for i in indices:
                    self.showing.marks[i] = 0
            self.clear_some_grads(params, indices, set_to_none)

    def forget_cleared_grads(self):
        """A p.grad that backward set and that was set to None since, outside
        zero_grad() (model.module.zero_grad(), or `p.grad = None`, torch's cheap
        zero_grad), clears that grad as in torch: the wrapper's own copy of it
        goes too, which the next backward would otherwise add to."""
        if not self.showing:  # zero_grad() since the last backward: nothing shown
            return
        shown = list(self.showing)
        if all(map(is_not, map(GRAD, shown), repeat(None))):  # the test, one pass in C: none cleared
            return
        self.model.zero_grad(params=[p for p in shown if p.grad is None])

    def remember_assigned_grads(self):
        """The p.grad tensors that the wrapper did not make, as a backward
        begins (assigned by the user: ddp steps with them, as torch would)."""
        grads = list(map(GRAD, self.model.buckets.params))
        if all(map(is_, grads, repeat(None))) or all(map(is_, grads, self.shown)):  # the usual: none assigned
            self.assigned = {}
            return
        self.assigned = {i: (grad, grad._version) for i, (grad, shown) in enumerate(zip(grads, self.shown))
                         if grad is not None and grad is not shown}

    def refuse_grads_from_autograd(self):
        """A p.grad that autograd made or added to in this backward: the
        parameter was used outside its layer (F.linear(x, layer.weight),
        x * norm.weight), where no strategy sees its grad, and it would be
        stepped without it (zero3 and fsdp even computed with a released
        parameter there)."""
        model = self.model
        grads = list(map(GRAD, model.buckets.params))
        if all(map(is_, grads, repeat(None))) or all(map(is_, grads, self.shown)):  # the usual, one pass in C
            return
        for i in model.trainable_indices:  # in the model's order: the first such parameter is named
            grad, before = grads[i], self.assigned.get(i, (None, None))
            if grad is None or grad is self.shown[i] or (grad is before[0] and grad._version == before[1]):
                continue
            name = model.name_of[model.buckets.params[i]]
            raise RuntimeError(f"{name} got a grad from autograd: it was used outside the layer that "
                               "holds it (as in F.linear(x, layer.weight) or x * norm.weight), where the strategy "
                               "neither gathers it nor sees its grad; use it through its layer (a tied nn.Linear "
                               "head, as GPT-2's), or give the other use a parameter of its own")

    @torch.no_grad()
    def clear_some_grads(self, params, indices, set_to_none):
        """zero_grad of some parameters only (`indices`: the indices of the
        trainable ones): their places in model.grads and in the buckets are
        zeroed (what the others hold stays)."""
        model = self.model
        names = {model.name_of[p] for p in params if p in model.name_of}
        for piece in model.state_dicts.all_pieces():
            grads = model.grads.get(piece.tensor)
            if grads is not None and piece.name in names:
                grads[piece.offset:piece.offset + piece.hi - piece.lo].zero_()
        buckets = model.buckets
        for i in indices:
            bucket = buckets.list[buckets.home[i]]
            if bucket.grads is not None:
                buckets.own_view(bucket.grads, i).zero_()
            bucket.parts.pop(i, None)
            if set_to_none:
                buckets.got_grad.marks[i] = 0
                buckets.expected.marks[i] = 0

    def refuse_foreign_grad(self, p):
        raise RuntimeError(f"{self.model.name_of[p]} has a p.grad that tiny_zero's layers did not make (the parameter "
                           "was used outside its layer, or p.grad was assigned): it would be ignored")

    def got_elsewhere(self, missing, stepping, everyone_missed, all_alike=False):
        """The parameters of `missing` (a forward on every rank used them; no
        grad came here) whose grad came on another rank: their averages hold
        it, and they step, as under torch DDP with find_unused_parameters.
        Where some rank missed none (the lowest count of the step's check),
        that is all of them; where every rank missed the same ones (a layer
        whose output no loss reads), none; else the ranks tell each other
        which they got: the one collective this costs, and only then.
        ddp, whose step's check is not waited for (everyone_missed None),
        tells by the averaged grads, which it holds whole: zero where no rank
        had a grad. (Where the ranks that had one all had exact zeros, they
        step it and this rank does not: the step's check then fails.)"""
        model = self.model
        if everyone_missed is None:
            got = [p for p in missing if self.averaged_grad(p).any()]  # a host read, where a grad is missing only
        elif everyone_missed and all_alike:
            got = []
        elif everyone_missed:
            names = model.name_of
            candidates = sorted(stepping + list(missing), key=names.get)  # the same on every rank (agreed)
            missing = set(missing)
            flags = torch.tensor([float(p not in missing) for p in candidates], device=model.device)
            comm.all_reduce(flags, group=model.replica_group)
            got = [p for p, n in zip(candidates, flags.tolist()) if p in missing and n > 0]
        else:
            got = list(missing)
        for p in got:
            model.buckets.got_grad.add(p)
            p.grad = self.shown_grad(p)
            self.showing.add(p)
        return got

    def averaged_grad(self, p):
        """p's averaged grad, where this rank holds it whole (one piece)."""
        model = self.model
        piece = next(piece for piece in model.state_dicts.all_pieces() if piece.name == model.name_of[p])
        return model.grads[piece.tensor][piece.offset:piece.offset + piece.hi - piece.lo]

    def take_assigned_grad(self, name, p):
        """p.grad was replaced by another tensor: copy it in where the rank holds
        the grad whole (ddp), as torch would step with it; else refuse."""
        mine = self.shown_grad(p)
        if isinstance(mine, ShardedGrad):
            raise RuntimeError(f"p.grad of {name} was replaced, but {type(self.model).__name__} keeps averaged grads "
                               "sharded: change grads through model.clip_grad_norm_ and the optimizer only")
        mine.copy_(p.grad)
        p.grad = mine

    def stepping(self, written):
        """The parameters the optimizer steps now: those whose p.grad is set,
        as torch.optim (zero_grad(set_to_none=True), or no grad in any backward
        since, leaves it None). Every rank agrees on them, and on how many
        parameters were `written` in place (param_writes) since the last step."""
        model = self.model
        self.forget_cleared_grads()
        check_requires_grad(model)
        buckets, got, shown = model.buckets, model.buckets.got_grad.marks, self.all_shown()
        if all(got) and all(map(is_, map(GRAD, buckets.params), shown)):  # the usual, in C: every grad as backward left it
            stepping = [buckets.params[i] for i in model.trainable_indices]
        else:
            stepping = []
            for i in model.trainable_indices:
                p = buckets.params[i]
                grad = p.grad
                if grad is None:
                    continue
                if not got[i]:
                    self.refuse_foreign_grad(p)
                if grad is not shown[i]:
                    self.take_assigned_grad(model.name_of[p], p)
                stepping.append(p)
        for p in model.frozen:
            if p.grad is not None:
                self.refuse_foreign_grad(p)
        missing = buckets.missing()  # got a grad on another rank, or none
        if missing and model.defer_step_agreement:  # the check below waits for the next backward: tell by the values
            stepping += self.got_elsewhere(missing, stepping, everyone_missed=None)
            missing = []
        spread = agreements.agree("the optimizer step", group=model.replica_group, wait=bool(missing), step=model.steps,
                            defer=model.defer_step_agreement,
                            parameters=parameter_hash(buckets, stepping + missing),
                            parameters_written_in_place=len(written), grads_missing=agreements.Spread(len(missing)),
                            grads_missing_named=agreements.Spread(parameter_hash(buckets, missing)))
        if missing:
            (fewest, _), (low, high) = spread["grads_missing"], spread["grads_missing_named"]
            stepping += self.got_elsewhere(missing, stepping, everyone_missed=fewest > 0, all_alike=low == high)
        buckets.expected.clear()  # the next step expects the grads of forwards after this one
        return stepping
