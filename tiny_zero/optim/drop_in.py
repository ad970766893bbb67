"""AdamW, a drop-in torch.optim.AdamW: each param group's parameters are
views of one flat buffer (`Flat`, per dtype and device), and a step is one
adamw_update_ (adamw.py) per buffer."""

import operator

import torch

from ..precision import take_written_
from .adamw import _check_kernel, adamw_update_, check_group, check_hparams, check_options, torch_adamw_update_many_


class Flat:
    """The parameters of one param group that share a dtype and a device, as views of one flat
    buffer (`param`), with their state flat beside it: exp_avg, exp_avg_sq and, for a
    low-precision dtype, the fp32 master. A parameter's pieces lie at offsets[i]:offsets[i + 1]."""

    def __init__(self, params, state):
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        like = dict(device=params[0].device, dtype=torch.float32)
        self.low = params[0].dtype != torch.float32
        self.param = torch.empty(self.offsets[-1], dtype=params[0].dtype, device=params[0].device)
        self.exp_avg = torch.zeros(self.offsets[-1], **like)
        self.exp_avg_sq = torch.zeros(self.offsets[-1], **like)
        self.master = torch.empty(self.offsets[-1], **like) if self.low else None
        self.states = [state.get(p) or None for p in params]  # state[p] once p has stepped, else None
        with torch.no_grad():
            for i, p in enumerate(params):
                self.param[self.span(i)].copy_(p.reshape(-1))
                if self.low:
                    saved = (self.states[i] or {}).get("master", p)
                    self.master[self.span(i)].copy_(saved.reshape(-1))
                if self.states[i]:  # its exp_avg and exp_avg_sq move in, and its state shows them where they now are
                    for key in ("exp_avg", "exp_avg_sq"):
                        getattr(self, key)[self.span(i)].copy_(self.states[i][key].reshape(-1))
                    self.point_state(i)
                p.data = self.param[self.span(i)].view(p.shape)
            if self.low:  # the parameter's elements that differ from the master's rounding win
                take_written_(self.master, self.param)
        self.pointers = [p.data_ptr() for p in params]
        self.versions = [p._version for p in params]  # the step writes self.param, never through p

    def span(self, i):
        return slice(self.offsets[i], self.offsets[i + 1])

    def point_state(self, i):
        """state[p] of the i-th parameter, as views of the flat buffers (created on its first step)."""
        state, shape, span = self.states[i], self.params[i].shape, self.span(i)
        state["step"] = int(state.get("step", 0))
        state["exp_avg"] = self.exp_avg[span].view(shape)
        state["exp_avg_sq"] = self.exp_avg_sq[span].view(shape)
        if self.low:
            state["master"] = self.master[span].view(shape)

    def intact(self):
        """Every parameter still shows its piece of the flat buffer (p.data was not replaced)."""
        return [p.data_ptr() for p in self.params] == self.pointers

    def take_writes(self):
        """Writes into a low-precision parameter since the last step go into its master (AdamW.take_write)."""
        versions = [p._version for p in self.params]
        if versions != self.versions:
            for i, (now, then) in enumerate(zip(versions, self.versions)):
                if now != then:
                    take_written_(self.master[self.span(i)], self.params[i].detach().reshape(-1))
            self.versions = versions

    def stretches(self, grads, state):
        """[(first, end, step)]: runs of consecutive parameters that step now (grad not None) with the
        same step count, after counting this step. A parameter stepping for the first time gets its state."""
        runs = []
        for i, grad in enumerate(grads):
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            if self.states[i] is None:
                self.states[i] = state[self.params[i]]
                self.point_state(i)
            step = self.states[i]["step"] = self.states[i]["step"] + 1
            if runs and runs[-1][1] == i and runs[-1][2] == step:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1, step])
        return runs


class AdamW(torch.optim.Optimizer):
    """Drop-in for torch.optim.AdamW (amsgrad=False, maximize=False), same defaults and state layout.

    On its first step, AdamW flattens each param group, as DeepSpeed and apex do: the group's
    parameters that require grad become views of one flat buffer (one per dtype and device), and
    their state is flat too. A step then copies the grads into one flat grad (one op) and runs one
    adamw_update_ over the flat range (one launch), not one per parameter. What that means for you:
      - p.data of a parameter is a view of the group's buffer from the first step on; a tensor
        that held p.data before (x = p.data) no longer is the parameter;
      - replacing p.data after that (model.to(), p.data = t) is seen at the next step: the group
        is flattened again from the new data, with its state;
      - opt.state[p]["exp_avg"] and the other state tensors are views of the flat state;
        opt.state[p]["step"] is a Python int; state_dict() gives torch's format (a float32 CPU
        tensor for "step", a tensor of the parameter's own for each state), so checkpoints of
        torch.optim.AdamW load here, and the other way round.
    A parameter without a grad in a step is not stepped and keeps its step count, as in torch.
    A parameter that does not require grad at the first step, or has an unusual layout, is stepped
    on its own; kernel="fused" steps the flat buffer one parameter at a time (torch's kernel rounds
    an element by its place in a vector; so it equals torch.optim.AdamW(fused=True) bit for bit).

    fp16/bf16 params get an fp32 master copy in state["master"]; the master is stepped and the
    param is written back in the same pass. exp_avg and exp_avg_sq are always fp32.
    `self.grad_scale` (float, default 1.0) multiplies every grad inside the update; whoever sets
    it (loss scaling, clipping) is responsible for resetting it.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, kernel="auto"):
        check_hparams(lr, betas, eps, weight_decay)
        _check_kernel(kernel)
        self.kernel = kernel
        self.grad_scale = 1.0
        self.versions = {}  # a low-precision parameter stepped apart -> its version after the step wrote it
        self.flattened = []  # per param group: (its params when flattened, [Flat], [params stepped apart])
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def add_param_group(self, param_group):
        check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            check_options(group)
            flats, apart = self.flat_group(index, group)
            for flat in flats:
                self.step_flat(flat, group)
            if apart:
                self.step_apart(apart, group)
        return loss

    def flat_group(self, index, group):
        """([Flat], [params stepped apart]) of a param group: flattened on its first step, and again
        when its parameter list changed or a parameter's data was replaced since."""
        params = group["params"]
        if index < len(self.flattened):
            known, flats, apart = self.flattened[index]
            if len(known) == len(params) and all(map(operator.is_, known, params)) and all(f.intact() for f in flats):
                return flats, apart
        del self.flattened[index:]  # this group and the ones after it flatten again
        by_kind, apart, seen = {}, [], set()
        for p in params:
            if id(p) in seen:  # a tied parameter listed twice is stepped once
                continue
            seen.add(id(p))
            if p.requires_grad and p.is_floating_point() and p.is_contiguous() and not p.is_sparse:
                by_kind.setdefault((p.dtype, p.device), []).append(p)
            else:
                apart.append(p)
        flats = [Flat(members, self.state) for members in by_kind.values()]
        self.flattened.append((list(params), flats, apart))
        return flats, apart

    def step_flat(self, flat, group):
        grads = [self.grad_of(p) for p in flat.params]
        if flat.low:
            flat.take_writes()
        beta1, beta2 = group["betas"]
        hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"], grad_scale=self.grad_scale, kernel=self.kernel)
        for first, end, step in flat.stretches(grads, self.state):
            if self.kernel == "fused":
                # torch's fused CPU kernel rounds an element by where it falls in a vector: stepped
                # per parameter, as torch.optim.AdamW(fused=True) steps them, it agrees bit for bit
                pieces = [(flat.span(i), grads[i].reshape(-1)) for i in range(first, end)]
            else:  # one op makes a fresh flat grad of the stretch, and one update steps it
                span = slice(flat.offsets[first], flat.offsets[end])
                pieces = [(span, torch._C._nn.flatten_dense_tensors(grads[first:end]))]
            for span, grad in pieces:
                work = flat.master[span] if flat.low else flat.param[span]
                adamw_update_(work, grad, flat.exp_avg[span], flat.exp_avg_sq[span], step=step,
                              param_out=flat.param[span] if flat.low else None, **hyper)

    def step_apart(self, params, group):
        """Step parameters that are not in a flat buffer, one by one (on the CPU in fp32, together)."""
        beta1, beta2 = group["betas"]
        together = []  # (param, grad, state) stepped at once with multi-tensor ops
        for p in params:
            grad = self.grad_of(p)
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            if not p.is_floating_point():
                raise RuntimeError(f"AdamW supports real floating-point params, got {p.dtype}")
            state = self.init_state(p)
            state["step"] += 1

            if self.kernel in ("auto", "torch") and not p.is_cuda and p.dtype == torch.float32:
                together.append((p, grad, state))  # the CPU's plain torch path: one call per formula line
                continue
            if p.dtype == torch.float32:
                work = p if p.is_contiguous() else p.contiguous()  # a copy only for unusual layouts
                out = None
            else:
                work = state["master"]
                self.take_write(p, work)
                out = p.view(-1) if p.is_contiguous() else None
            adamw_update_(work.view(-1), grad.reshape(-1), state["exp_avg"].view(-1),
                          state["exp_avg_sq"].view(-1), lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                          eps=group["eps"], weight_decay=group["weight_decay"], step=state["step"],
                          grad_scale=self.grad_scale, param_out=out, kernel=self.kernel)
            if work is not p and out is None:
                p.copy_(work)
            if p.dtype != torch.float32:
                self.versions[p] = p._version  # the step's own write is not the user's
        if together:
            params, grads, states = zip(*together)
            torch_adamw_update_many_(list(params), list(grads), [s["exp_avg"] for s in states],
                                     [s["exp_avg_sq"] for s in states], lr=float(group["lr"]), beta1=beta1,
                                     beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                                     steps=[s["step"] for s in states], grad_scale=self.grad_scale)

    def take_write(self, p, master):
        """A write into a low-precision p in place since the step last wrote it
        (p.mul_(mask), p.clamp_(), nn.init: its version counter moved) lasts,
        as in torch: the elements it changed go into the fp32 master, which the
        step would otherwise write back over them."""
        if self.versions.get(p) != p._version:
            take_written_(master, p.detach())

    def grad_of(self, param):
        """The grad to step `param` with (strategies keep theirs elsewhere)."""
        return param.grad

    @torch.no_grad()
    def init_state(self, p):
        """p's state, created as the first step creates it (step 0, zero exp_avg and exp_avg_sq, an fp32 master
        for a low-precision p) if it does not exist yet."""
        state = self.state[p]
        if len(state) == 0:
            state["step"] = 0
            fp32_zeros = dict(dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg"] = torch.zeros_like(p, **fp32_zeros)
            state["exp_avg_sq"] = torch.zeros_like(p, **fp32_zeros)
            if p.dtype != torch.float32:
                state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        return state

    def state_dict(self):
        """torch's format: "step" a float32 CPU tensor, and each state tensor a parameter's own
        (a copy of a view into a flat buffer, which would otherwise save the whole buffer)."""
        saved = super().state_dict()
        saved["state"] = {i: {key: torch.tensor(float(value), dtype=torch.float32) if key == "step"
                              else value.clone() if value._base is not None else value
                              for key, value in state.items()}
                          for i, state in saved["state"].items()}
        return saved

    def load_state_dict(self, state_dict):
        # torch casts floating-point state to each param's dtype; our moments and master stay fp32.
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(i, {}).items():
                if key == "step":
                    self.state[p][key] = int(value)
                else:
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32,
                                                  memory_format=torch.contiguous_format)
        self.flattened = []  # the next step flattens the loaded state in
