"""DeepSpeed's learning-rate schedules, with its formulas (deepspeed/runtime/lr_schedules.py).

Each sets every param group's lr at construction (step -1) and at each
step(); the engine steps it once per optimizer step that was not skipped.

    WarmupLR        min_lr + (max_lr - min_lr) * gamma, gamma rising over warmup_num_steps
                    ("log": log(step + 1) / log(warmup_num_steps); "linear": step / warmup_num_steps),
                    then 1
    WarmupDecayLR   the same warmup, then gamma falls linearly to 0 at total_num_steps
    WarmupCosineLR  lr * ratio: the ratio rises from warmup_min_ratio to 1 as above, then follows a
                    cosine down to cos_min_ratio at total_num_steps
"""
import math

LOG, LINEAR = "log", "linear"


class WarmupLR:
    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type=LOG, last_batch_iteration=-1):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        if warmup_type not in (LOG, LINEAR):
            raise ValueError(f"warmup_type must be {LOG!r} or {LINEAR!r}, got {warmup_type!r}")
        self.optimizer = optimizer
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)  # DeepSpeed's: log(1) would divide by zero
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self.set_lrs()

    def warmup_gamma(self):
        """From 0 to 1 over the warmup."""
        if self.warmup_type == LOG:
            return math.log(self.last_batch_iteration + 1) / math.log(self.warmup_num_steps)
        return self.last_batch_iteration / self.warmup_num_steps

    def gamma(self):
        return self.warmup_gamma() if self.last_batch_iteration < self.warmup_num_steps else 1.0

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self.gamma()
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]

    def set_lrs(self):
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self):
        return self._last_lr

    def step(self, last_batch_iteration=None):
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self.set_lrs()

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state):
        self.last_batch_iteration = state["last_batch_iteration"]
        self.set_lrs()


class WarmupDecayLR(WarmupLR):
    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type=LOG, last_batch_iteration=-1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return self.warmup_gamma()
        return max(0.0, (self.total_num_steps - self.last_batch_iteration)
                   / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(WarmupLR):
    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type=LOG, last_batch_iteration=-1):
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        super().__init__(optimizer, 0.0, self.org_lrs, warmup_num_steps, warmup_type, last_batch_iteration)

    def ratio(self):
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + self.warmup_gamma() * (1.0 - self.warmup_min_ratio)
        done = self.last_batch_iteration - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self):
        return [lr * self.ratio() for lr in self.org_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def per_group(optimizer, value, name):
    """A number for every param group, or a list with one per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name}: expected {len(optimizer.param_groups)} values (one per param group), "
                             f"got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)
