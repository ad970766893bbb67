"""The optimizer step, after backward: the clip, fp16's overflow check and
AdamW on what this rank holds.

Clipping, held by Wrapper as model.clipping: clip_grad_norm_ (the
all-reduce of the grads' squared norm, where a rank holds only part of
them), the scale the update multiplies the grads by (unscale and clip),
fp16's overflow flag (its all-reduce). StrategyAdamW: the optimizer every
strategy's optim.py points at its wrapper; it steps model.shards with
model.grads, per parameter group."""
import torch

from . import agreements, comm
from .optim import adamw_update_
from .optim.adamw import check_group, check_hparams, check_options
from .optimizer_state_dicts import OptimizerStateDicts
from .step_counts import StepCounts


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
    share a group and a step count (usually one launch per shard). The counts
    and the stretches are held as opt.counts (step_counts.py)."""

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
        self.counts = StepCounts(model)

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
        """The parameters that step, their stretches of the shards, and one
        AdamW update per stretch."""
        counts = self.counts
        stepped = counts.indices(stepping, self.param_groups)
        runs = counts.runs(stepped, self.param_groups)
        counts.advance(stepped, found_inf)
        for shard_index, lo, hi, group, first in runs:
            shard = self.model.shards[shard_index]
            beta1, beta2 = group["betas"]
            exp_avg, exp_avg_sq = self.adam_state(shard)
            out = self.model.working.get(shard)
            adamw_update_(shard[lo:hi], self.model.grads[shard][lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi],
                          lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                          weight_decay=group["weight_decay"], step=counts.count(first), grad_scale=grad_scale,
                          param_out=None if out is None else out[lo:hi], kernel=self.kernel, found_inf=found_inf)

    def adam_state(self, shard):
        state = self.state[shard]
        if not state:
            state["exp_avg"] = torch.zeros_like(shard)
            state["exp_avg_sq"] = torch.zeros_like(shard)
        return state["exp_avg"], state["exp_avg_sq"]

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none, params=[p for group in self.param_groups for p in group["params"]])
