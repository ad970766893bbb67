"""The optimizer step, after backward: the clip, fp16's overflow check and
AdamW on what this rank holds.

Clipping, held by Wrapper as model.clipping: clip_grad_norm_ (the
all-reduce of the grads' squared norm, where a rank holds only part of
them), the scale the update multiplies the grads by (unscale and clip),
fp16's overflow flag (its all-reduce). StrategyAdamW: the optimizer every strategy's optim.py
points at its wrapper; it steps model.shards with model.grads, per
parameter group."""
from itertools import groupby

import torch

from . import agreements, comm
from .optim import adamw_update_
from .optim.adamw import check_group, check_hparams, check_options
from .optimizer_state_dicts import OptimizerStateDicts


class Clipping:
    """Held by Wrapper as model.clipping: the clip, and what the step
    multiplies the grads by (unscale and clip), with fp16's overflow check."""

    def __init__(self, model):
        self.model = model
        self.coef = None  # a clip's coefficient, pending (a 0-d tensor on the grads' device)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """torch.nn.utils.clip_grad_norm_ on the unsharded model: returns the
        global norm before clipping (a device tensor, which the host never
        waits for; of the unscaled grads under fp16). Sharded grads are clipped
        in the optimizer's kernel, with the loss scale; where p.grad shows the
        grads (ddp), here, as torch's."""
        model = self.model
        comm.where = "clip_grad_norm_"
        # every rank clips, by the same max_norm (a rank alone would send the norm's all-reduce alone, or
        # under ddp, which sends none, step its replica apart); checked before the rank's next collective
        agreements.agree("clip_grad_norm_", wait=False, max_norm=agreements.value_hash(float(max_norm)))
        if model._join_config.enable:  # a rank that runs out clips as its last step did (join.py)
            model.joining.clip = max_norm
        model.torch_grads.forget_cleared_grads()
        self.apply()  # a second clip sees the grads of the first, as torch's
        total_norm = model.grad_square_sum().sqrt()
        if model.loss_scaler is not None:
            total_norm = total_norm / model.loss_scaler.on(model.device)
        self.coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        if model.torch_grads.grads_shown_whole():
            self.apply()  # p.grad is model.grads (ddp): clipped now, as torch leaves it, for what edits it next
        return total_norm

    @torch.no_grad()
    def apply(self):
        """Multiply the pending clip coefficient into model.grads, and forget
        it. The optimizer's kernel applies it as it reads the grads, and it
        stays pending after the step (a second step uses the clipped grads, as
        in torch); whatever else reads or adds to the grads after a clip (a
        second clip, a backward before zero_grad) gets them as torch's
        clip_grad_norm_ leaves them: clipped, at the cost of this one pass."""
        if self.coef is not None:
            for g in self.model.grads.values():
                g.mul_(self.coef)
            self.coef = None

    def grad_square_sum(self):
        """The sum of the squares of the model's averaged grads, every element
        counted once (a scalar fp32 tensor, the same on every rank)."""
        square_sum = self.local_square_sum()
        if not self.model.grads_replicated:
            comm.all_reduce(square_sum)  # each rank holds a disjoint part
        return square_sum

    def local_square_sum(self):
        """This rank's part of grad_square_sum(): the squares of the grads it holds."""
        model = self.model
        square_sum = torch.zeros((), dtype=torch.float32, device=model.device)
        for g in model.grads.values():
            square_sum += g.float().square().sum()
        return square_sum

    def grad_scale(self):
        """What the optimizer multiplies the grads by: unscale and clip (a
        number, or a 0-d tensor on the grads' device under fp16 or after a clip)."""
        model = self.model
        if model.loss_scaler is not None:
            scale = model.loss_scaler.on(model.device).reciprocal()
            return scale if self.coef is None else self.coef * scale
        return 1.0 if self.coef is None else self.coef

    @torch.no_grad()
    def found_overflow(self):
        """fp16: did any rank get an inf/nan grad? A 0-d fp32 tensor on the
        device, 1.0 or 0.0, after one all-reduce, so that every rank skips
        alike; the host never reads it (the kernel does: found_inf). None
        without fp16."""
        model = self.model
        if model.loss_scaler is None:
            return None
        bad = torch.zeros((), dtype=torch.float32, device=model.device)
        for g in model.grads.values():
            bad += (~torch.isfinite(g)).sum()
        comm.all_reduce(bad)
        return (bad > 0).float()


class StrategyAdamW(OptimizerStateDicts, torch.optim.Optimizer):
    """AdamW over what the wrapper says this rank holds: model.shards, with
    model.grads. A drop-in for torch.optim.AdamW on the wrapped model:

        opt = Zero2AdamW(model, lr=1e-3, weight_decay=0.1)
        opt = Zero2AdamW(model, [{"params": decay, "weight_decay": 0.1},
                                 {"params": ["ln.weight", ...], "weight_decay": 0.0}], lr=1e-3)

    Params are the module's parameters (before or after wrapping: the same
    objects) or their names. opt.param_groups drive the next step (lr
    schedulers work). Each parameter keeps its own step count, as torch's
    does: one that has no grad is not stepped. A shard's AdamW state is flat, like
    the shard; the update runs once per stretch of a shard whose parameters
    share a group and a step count (usually one launch per shard)."""

    wrapper = None  # the wrapper class this optimizer belongs to, set by each strategy
    kernel = "auto"  # adamw_update_'s: the Triton kernel on CUDA, plain torch on the CPU

    def __init__(self, model, params=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        if not isinstance(model, self.wrapper):
            raise TypeError(f"{type(self).__name__} steps a {self.wrapper.__name__}-wrapped model, "
                            f"got {type(model).__name__}: use the optimizer of the model's strategy "
                            "(tiny_zero.STRATEGIES[name])")
        self.model = model
        self.skipped_steps = 0
        check_hparams(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(self._groups(params), defaults)
        # A parameter's index: its place in model.named_params; the step's bookkeeping is by index
        # (a dict keyed by Parameter objects hashes each one in Python, thousands of times a step).
        params = [p for _, p in model.named_params]
        self.index_of = {id(p): i for i, p in enumerate(params)}
        # Step counts. fp32, bf16: Python ints, as every step the host takes happens. fp16: a skip is
        # decided on the device, so the counts are a tensor there (where the shards are), advanced by
        # (1 - found_inf); the kernel reads its run's. `stamps` (fp16; and loaded counts): a hash of the
        # steps each parameter was stepped in (equal stamps, equal counts), which groups the runs without
        # reading the counts.
        self.counts = [0] * len(params)
        self.stamps = [0] * len(params)
        device = model.shards[0].device if model.shards else model.device
        self.device_counts = torch.zeros(len(params), device=device) if model.loss_scaler is not None else None
        self.masks = {}  # fp16: the stepping parameters' indices -> a 0/1 tensor over the counts
        position = {id(s): i for i, s in enumerate(model.shards)}
        pieces = sorted((p for p in model.state_dicts.all_pieces() if id(p.tensor) in position),
                        key=lambda p: (position[id(p.tensor)], p.offset))  # in layout order
        by_name = dict(model.named_params)
        # (parameter index, shard index, lo, hi) of each piece this rank steps, in layout order
        self.piece_rows = [(self.index_of[id(by_name[p.name])], position[id(p.tensor)], p.offset,
                            p.offset + p.hi - p.lo) for p in pieces]
        self.cached_runs = None  # (the key runs() was computed for, its runs)
        self.group_key = None  # the param groups that group_index was computed for
        self.group_index = [None] * len(params)  # each parameter's group (its index), None if none

    @property
    def skipped_steps(self):
        """Steps skipped for an fp16 overflow: under fp16 counted on the device,
        and read (a wait for the device) only here; otherwise a number."""
        return self.skips if isinstance(self.skips, int) else int(self.skips.item())

    @skipped_steps.setter
    def skipped_steps(self, n):
        fp16 = self.model.loss_scaler is not None
        self.skips = torch.tensor(float(n), device=self.model.device) if fp16 else int(n)

    def _groups(self, params):
        """torch-style groups, with names turned into the module's parameters."""
        by_name = dict(self.model.named_params)
        if params is None:
            params = [p for _, p in self.model.named_params]
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        out = []
        for group in groups:
            group = dict(group)
            items = group["params"]
            items = [items] if isinstance(items, (str, torch.Tensor)) else list(items)
            for item in items:
                if isinstance(item, str) and item not in by_name:
                    raise ValueError(f"{type(self).__name__}: no parameter named {item!r} in the model "
                                     f"(names are the module's: {', '.join(list(by_name)[:4])}, ...)")
            group["params"] = [by_name[p] if isinstance(p, str) else p for p in items]
            out.append(group)
        return out

    def add_param_group(self, param_group):
        known = {id(p) for _, p in self.model.named_params}
        params = param_group["params"]
        params = [params] if isinstance(params, (str, torch.Tensor)) else list(params)
        by_name = dict(self.model.named_params)
        params = [by_name.get(p, p) if isinstance(p, str) else p[1] if isinstance(p, tuple) else p for p in params]
        for p in params:
            if isinstance(p, str) or id(p) not in known:
                got = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else repr(p)[:80]
                raise ValueError(f"{type(self).__name__} steps the wrapped model's parameters only, got {got}")
        check_group({**self.defaults, **param_group})
        super().add_param_group({**param_group, "params": params})

    @property
    def loss_scale(self):
        return self.model.loss_scale

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        model = self.model
        comm.where = "the optimizer step"
        for group in self.param_groups:
            check_options(group)
        model.free_gathered()
        written = model.state_dicts.param_writes()
        stepping = model.stepping(written)
        model.state_dicts.adopt_param_writes(written)  # after the agreement on how many were written
        found_inf = model.clipping.found_overflow()  # fp16: on the device; every rank skips alike, the host never knows
        # unscaled by the scale the grads were made with
        self._update(stepping, *model.where_the_step_runs(model.clipping.grad_scale(), found_inf))
        if found_inf is not None:
            model.loss_scaler.update(found_inf)
            self.skips.add_(found_inf)
        model.sync_params()
        if model._join_config.enable:  # a rank that runs out steps with this optimizer (join.py)
            model.joining.optimizer = self
        model.steps += 1
        model.backwards = 0
        return loss

    def _update(self, stepping, grad_scale, found_inf):
        index_of, group_index = self.index_of, self.update_group_index()
        stepped = list(map(index_of.__getitem__, map(id, stepping)))  # in C: a step's longest loop
        if None in group_index:  # some of the model's parameters are in no group of this optimizer
            stepped = [i for i in stepped if group_index[i] is not None]
        runs = self.runs(stepped)
        self.advance(stepped, found_inf)
        for shard_index, lo, hi, group, first in runs:
            shard = self.model.shards[shard_index]
            beta1, beta2 = group["betas"]
            exp_avg, exp_avg_sq = self.adam_state(shard)
            out = self.model.working.get(shard)
            step = self.counts[first] if self.device_counts is None else self.device_counts[first]
            adamw_update_(shard[lo:hi], self.model.grads[shard][lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi],
                          lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                          weight_decay=group["weight_decay"], step=step, grad_scale=grad_scale,
                          param_out=None if out is None else out[lo:hi], kernel=self.kernel, found_inf=found_inf)

    def advance(self, stepped, found_inf):
        """The step counts of the parameters `stepped` (indices) go up by one,
        before their update reads them; under fp16 on the device, where the
        step was not skipped, in one op."""
        if self.device_counts is None:
            counts = self.counts
            for i in stepped:
                counts[i] += 1
            return
        stamps, step = self.stamps, self.model.steps  # runs tells counts apart by these (it reads counts in fp32)
        for i in stepped:
            stamps[i] = (stamps[i] * 31 + step + 1) % (1 << 61)
        key = tuple(stepped)
        if key not in self.masks:
            mask = torch.zeros(len(self.counts))
            mask[list(stepped)] = 1.0
            self.masks[key] = mask.to(self.device_counts.device)  # once per set of stepping parameters
        self.device_counts.addcmul_(self.masks[key], 1 - found_inf.to(self.device_counts.device))

    def update_group_index(self):
        """group_index, recomputed only when the param groups changed."""
        key = tuple((id(g["params"]), len(g["params"])) for g in self.param_groups)
        if key != self.group_key:
            self.group_index = [None] * len(self.counts)
            for g, group in enumerate(self.param_groups):
                for p in group["params"]:
                    self.group_index[self.index_of[id(p)]] = g
            self.group_key = key
        return self.group_index

    def adam_state(self, shard):
        state = self.state[shard]
        if not state:
            state["exp_avg"] = torch.zeros_like(shard)
            state["exp_avg_sq"] = torch.zeros_like(shard)
        return state["exp_avg"], state["exp_avg_sq"]

    def count(self, i):
        """Parameter i's step count, a number (under fp16 a host read: for a save)."""
        return self.counts[i] if self.device_counts is None else float(self.device_counts[i])

    def set_count(self, i, step):
        if self.device_counts is None:
            self.counts[i] = int(step)
        else:
            self.device_counts[i] = float(step)
        self.stamps[i] = (1 << 60) + int(step)  # equal counts, equal stamps: no history to tell them apart
        self.cached_runs = None

    def runs(self, stepped):
        """(shard index, lo, hi, group, first parameter's index): the stretches
        of shards to update, one launch each: adjacent pieces of parameters
        that step now (indices), in the same group, with the same step count.
        A piece that does not step ends a stretch. Made again only when the
        parameters that step, or the groups, change: where the same ones step
        as last time, their counts all moved together."""
        key = (tuple(stepped), self.group_key)
        if self.cached_runs is not None and self.cached_runs[0] == key:
            return self.cached_runs[1]
        steps = [False] * len(self.counts)
        for i in stepped:
            steps[i] = True
        stamps, group_index = self.counts if self.device_counts is None else self.stamps, self.group_index
        keys = [(shard, group_index[i], stamps[i]) if steps[i] else None for i, shard, _, _ in self.piece_rows]
        runs = []
        for run_key, same in groupby(zip(keys, self.piece_rows), key=lambda item: item[0]):
            if run_key is None:
                continue
            rows = [row for _, row in same]
            (first, shard, lo, _), hi = rows[0], rows[-1][3]
            runs.append((shard, lo, hi, self.param_groups[run_key[1]], first))
        self.cached_runs = (key, runs)
        return runs

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none, params=[p for group in self.param_groups for p in group["params"]])
