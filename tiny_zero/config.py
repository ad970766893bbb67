"""DeepSpeed's JSON config, read into what tiny_zero runs (docs/deepspeed.md).

    config = read_config("ds_config.json", world_size=8)
    config.strategy        "ddp", "zero1", "zero2", "fsdp" or "offload"
    config.offload_optimizer, config.offload_params
                           stage 3 with offload: fsdp's FSDPOffload (tiny_zero/engine.py: strategy_classes)
    config.changed         [(key, what it does here)]: the keys that set something
    config.no_effect       [(key, why)]: keys that tune only DeepSpeed's speed or logging

Every key of every level is one of: read (it sets something below), no
effect (it tunes only how fast DeepSpeed runs, or what it logs: one line says
so), or refused (it would change the numbers and tiny_zero does not do it:
an error names it). Any other key is a misspelling: an error suggests the
nearest real one. The config is the same on every rank, so every rank
raises the same error.
"""
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config_keys import ADAM, BF16, FP16, OFFLOAD, OFFLOAD_PARAM, OPTIMIZER, READ, SCHEDULER, SCHEDULER_PARAMS, TOP, ZERO

STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}  # DeepSpeed's stage 3 slices every tensor, as fsdp does
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Config:
    world_size: int
    strategy: str = "ddp"
    stage: int = 0  # zero_optimization.stage
    train_batch_size: int = 0
    micro_batch: int = 0
    accumulation: int = 1  # gradient_accumulation_steps
    optimizer: dict = field(default_factory=dict)  # lr, betas, eps, weight_decay
    scheduler: tuple = None  # (type, params)
    clip: float = 1.0  # DeepSpeed's default
    mixed_precision: str = None  # None (fp32), "bf16", "fp16"
    loss_scale: dict = None  # fp16: static scale, or the dynamic scaler's settings
    reduce_dtype: torch.dtype = None
    bucket_elements: int = None  # reduce_bucket_size; None: the wrappers' default bucket_bytes
    offload_optimizer: bool = False  # the optimizer in host memory (stage 3: FSDPOffload; else the offload strategy)
    offload_params: bool = False  # stage 3: the parameters' slices in host memory too
    drop_last: bool = False
    changed: list = field(default_factory=list)  # (key, what it does here)
    no_effect: list = field(default_factory=list)  # (key, why)

    def wrapper_options(self):
        """The keyword arguments of the strategy's wrapper (loss_scaler apart)."""
        options = {"mixed_precision": self.mixed_precision, "reduce_dtype": self.reduce_dtype}
        if self.bucket_elements is not None and self.strategy != "fsdp":
            options["bucket_bytes"] = self.bucket_bytes()
        if self.offload_params:
            options["offload_params"] = True
        return options

    def bucket_bytes(self):
        """DeepSpeed counts a bucket in elements; tiny_zero in bytes of the parameter dtype."""
        size = torch.finfo(DTYPES[self.mixed_precision or "fp32"]).bits // 8
        return int(self.bucket_elements) * size


def load_json(config):
    """A dict, or a path to a JSON file."""
    if isinstance(config, dict):
        return config
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config {str(path)!r}: no such file")
    return json.loads(path.read_text())


def read_config(config, world_size):
    """Config from DeepSpeed's JSON (a dict or a path), for `world_size` ranks."""
    c = Config(world_size)
    raw = resolve_aliases(load_json(config), TOP, "", c)
    sort_keys(raw, TOP, "", c)
    read_batch(raw, c)
    read_precision(raw, c)
    read_zero(raw.get("zero_optimization", {}), c)
    read_optimizer(raw.get("optimizer"), c)
    read_scheduler(raw.get("scheduler"), c)
    c.clip = float(raw.get("gradient_clipping", 1.0))
    c.changed.append(("gradient_clipping", f"clip_grad_norm_({c.clip}) before each step" if c.clip > 0
                      else "0: no clipping"))
    if "communication_data_type" in raw and raw["communication_data_type"] is not None:
        name = raw["communication_data_type"]
        if name not in DTYPES:
            raise ValueError(f"communication_data_type must be one of {list(DTYPES)}, got {name!r}")
        c.reduce_dtype = DTYPES[name]
        c.changed.append(("communication_data_type", f"reduce_dtype={name}: the grads are averaged in {name}"))
    c.drop_last = bool(raw.get("dataloader_drop_last", False))
    return c


def resolve_aliases(section, known, prefix, c):
    """A copy of `section` with each alias (DeepSpeed's other name for a key) under the name tiny_zero reads.
    Given both names, DeepSpeed reads one; here they must agree."""
    if not isinstance(section, dict):
        return section
    out = dict(section)
    for key, value in section.items():
        rule = known.get(key)
        if isinstance(rule, tuple) and rule[0] == "alias":
            target = rule[1]
            if target in section and section[target] != value:
                raise ValueError(f"DeepSpeed config: {prefix}{key} and {prefix}{target} name the same setting "
                                 "with different values; keep one")
            out[target] = out.pop(key)
            c.changed.append((prefix + key, f"read as {prefix}{target}, its other name"))
    return out


def sort_keys(section, known, prefix, c, off=None):
    """Check every key of `section` against `known`; note the no-effect ones, refuse the others.
    `off`: why the whole section changes nothing (fp16 not enabled): its keys are noted, none refused."""
    if not isinstance(section, dict):
        raise ValueError(f"DeepSpeed config: {prefix or 'the config'} must be a JSON object, got {section!r}")
    for key, value in section.items():
        name = prefix + key
        if key not in known:
            near = difflib.get_close_matches(key, list(known), n=1)
            hint = f"; did you mean {prefix + near[0]!r}?" if near else f"; the keys here: {', '.join(known)}"
            raise ValueError(f"DeepSpeed config: unknown key {name!r}{hint}")
        if value == "auto":
            raise ValueError(f"DeepSpeed config: {name} = \"auto\", which transformers' Trainer fills in: DeepSpeed "
                             "takes \"auto\" for the default only within fp16, bf16 and zero_optimization; "
                             f"set {name}")
        rule = known[key]
        if rule == READ:
            continue
        if off is not None:
            c.no_effect.append((name, off))
        elif rule[0] == "no effect":
            c.no_effect.append((name, rule[1]))
        elif value is not None and not rule[1](value):  # null: the default, as DeepSpeed's pydantic reads it
            raise ValueError(f"DeepSpeed config: {name} = {json.dumps(value)} is not supported by tiny_zero "
                             f"({rule[2]}); it would change the numbers, so it is refused rather than ignored")


def read_batch(raw, c):
    """DeepSpeed's rule: any two of the three imply the third; all three must agree."""
    batch, micro, acc = (raw.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                              "gradient_accumulation_steps"))
    n = c.world_size
    if batch is not None and micro is not None and acc is None:
        acc = batch // micro // n
    elif batch is not None and acc is not None and micro is None:
        micro = batch // n // acc
    elif micro is not None and batch is None:
        acc = 1 if acc is None else acc
        batch = micro * acc * n
    elif batch is not None and micro is None:
        acc, micro = 1, batch // n
    elif batch is None:
        raise ValueError("DeepSpeed config: either train_batch_size or train_micro_batch_size_per_gpu must be given")
    if batch <= 0 or micro <= 0 or acc <= 0 or batch != micro * acc * n:
        raise ValueError(f"DeepSpeed config: check the batch keys: train_batch_size ({batch}) must equal "
                         f"train_micro_batch_size_per_gpu ({micro}) * gradient_accumulation_steps ({acc}) "
                         f"* world size ({n}), each above 0")
    c.train_batch_size, c.micro_batch, c.accumulation = batch, micro, acc
    c.changed.append(("train_batch_size", f"{batch} = {micro} per rank x {acc} micro-steps x {n} ranks"))
    if acc > 1:
        c.changed.append(("gradient_accumulation_steps", f"{acc}: engine.backward divides the loss by {acc}; at "
                          "stages 2 and 3 every micro-step reduce-scatters its grads into the rank's shard, at 0 "
                          f"and 1 the first {acc - 1} backward passes of a step run in model.no_sync()"))


def without_auto(section, prefix, c):
    """A section that DeepSpeed reads with its pydantic models (fp16, bf16,
    zero_optimization, its offload_optimizer): a value "auto" is dropped
    there, so the key takes its default, as DeepSpeed does."""
    if not isinstance(section, dict):
        return section
    c.changed += [(prefix + k, '"auto": the default, as DeepSpeed reads it') for k, v in section.items() if v == "auto"]
    return {k: v for k, v in section.items() if v != "auto"}


TRUE, FALSE = ("true", "t", "yes", "y", "on", "1"), ("false", "f", "no", "n", "off", "0")


def flag(section, key, prefix):
    """A true/false key as DeepSpeed's pydantic reads it: a bool, 0 or 1, or a word ("true", "false", "yes", ...)."""
    value = section.get(key, False)
    if isinstance(value, str) and value.lower() in TRUE + FALSE:
        return value.lower() in TRUE
    if isinstance(value, (bool, int)) and value in (0, 1):
        return bool(value)
    raise ValueError(f"DeepSpeed config: {prefix}{key} must be true or false, got {json.dumps(value)}")


def read_precision(raw, c):
    fp16, bf16 = (without_auto(raw.get(key) or {}, key + ".", c) for key in ("fp16", "bf16"))
    fp16_on, bf16_on = flag(fp16, "enabled", "fp16."), flag(bf16, "enabled", "bf16.")
    sort_keys(fp16, FP16, "fp16.", c, off=None if fp16_on else "fp16 is not enabled")
    sort_keys(bf16, BF16, "bf16.", c, off=None if bf16_on else "bf16 is not enabled")
    if fp16_on and bf16_on:
        raise ValueError("DeepSpeed config: fp16.enabled and bf16.enabled are both true; choose one")
    if bf16_on:
        c.mixed_precision = "bf16"
        c.changed.append(("bf16.enabled", "mixed_precision='bf16': bf16 parameters and grads, fp32 masters"))
    elif fp16_on:
        c.mixed_precision = "fp16"
        static = float(fp16.get("loss_scale", 0))
        c.loss_scale = {"static": static} if static > 0 else {
            "init_scale": 2.0 ** fp16.get("initial_scale_power", 16), "window": fp16.get("loss_scale_window", 1000),
            "hysteresis": fp16.get("hysteresis", 2), "min_scale": fp16.get("min_loss_scale", 1)}
        what = f"a static loss scale of {static:g}" if static > 0 else "LossScaler({})".format(
            ", ".join(f"{k}={v:g}" for k, v in c.loss_scale.items()))
        c.changed.append(("fp16.enabled", f"mixed_precision='fp16' with {what} (tiny_zero/precision.py)"))


def read_zero(zero, c):
    if isinstance(zero, bool):  # DeepSpeed's oldest form: true is stage 1
        zero = {"stage": int(zero)}
    zero = resolve_aliases(without_auto(zero or {}, "zero_optimization.", c), ZERO, "zero_optimization.", c)
    sort_keys(zero, ZERO, "zero_optimization.", c)
    stage = zero.get("stage", 0)
    if stage not in STAGES:
        raise ValueError(f"DeepSpeed config: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    c.strategy, c.stage = STAGES[stage], stage
    c.changed.append(("zero_optimization.stage", f"{stage}: tiny_zero.{c.strategy}"))
    if offload_device(zero, "offload_optimizer", "cpu_offload", OFFLOAD, c) == "cpu":
        c.offload_optimizer = True
        if stage == 0:
            raise ValueError("DeepSpeed config: offload_optimizer with stage 0 is not supported by tiny_zero: its "
                             "offloads step each rank's shard of the optimizer; use stage 2 (or 3) with it")
        if stage == 3:
            c.changed.append(("zero_optimization.offload_optimizer.device", "cpu: tiny_zero/fsdp/wrapper.py: FSDPOffload "
                              "(each rank's fp32 masters, grads and AdamW of its slices in host memory)"))
        else:
            c.strategy = "offload"
            c.changed.append(("zero_optimization.offload_optimizer.device", "cpu: tiny_zero.offload (fp32 masters "
                              "and AdamW in host memory)"))
    if offload_device(zero, "offload_param", "cpu_offload_param", OFFLOAD_PARAM, c) == "cpu":
        if stage != 3 or not c.offload_optimizer:
            raise ValueError("DeepSpeed config: zero_optimization.offload_param.device = 'cpu' is supported by "
                             "tiny_zero at stage 3 with offload_optimizer.device 'cpu' only (the parameters' slices "
                             "in host memory, stepped there): add those, or set its device to 'none'")
        c.offload_params = True
        c.changed.append(("zero_optimization.offload_param.device", "cpu: FSDPOffload(offload_params=True) (each "
                          "rank's parameter slices in host memory, copied up for their all-gather)"))
    if "reduce_bucket_size" in zero:
        c.bucket_elements = int(zero["reduce_bucket_size"])
        if c.strategy == "fsdp":
            c.no_effect.append(("zero_optimization.reduce_bucket_size", "fsdp reduce-scatters one unit (a block) "
                                "at a time"))
        else:
            c.changed.append(("zero_optimization.reduce_bucket_size", f"{c.bucket_elements:,} elements: "
                              f"bucket_bytes={c.bucket_bytes():,}"))


def offload_device(zero, key, old_key, known, c):
    """offload_optimizer's or offload_param's device: "none" or "cpu". null is off, as in DeepSpeed;
    old_key (cpu_offload, cpu_offload_param) true is DeepSpeed's older way of saying device "cpu"."""
    prefix = f"zero_optimization.{key}."
    section = without_auto(zero.get(key) or {}, prefix, c)
    sort_keys(section, known, prefix, c)
    device = section.get("device") or "none"
    if zero.get(old_key):
        device = "cpu"
        c.changed.append(("zero_optimization." + old_key, f"true: read as {prefix}device 'cpu', its older name"))
    if device not in ("none", "cpu"):
        raise ValueError(f"DeepSpeed config: {prefix}device = {device!r} is not supported by tiny_zero "
                         "(only 'cpu' or 'none')")
    return device


def read_optimizer(section, c):
    if section is None:  # the script passes its own: initialize(optimizer=...)
        return
    sort_keys(section, OPTIMIZER, "optimizer.", c)
    kind = str(section.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        raise ValueError(f"DeepSpeed config: optimizer.type {section.get('type')!r} is not supported by "
                         "tiny_zero (Adam or AdamW)")
    params = dict(section.get("params", {}))
    if "max_grad_norm" in params:
        raise ValueError("DeepSpeed config: optimizer.params.max_grad_norm is not supported (as in DeepSpeed); "
                         "use gradient_clipping")
    sort_keys(params, ADAM, "optimizer.params.", c)
    decoupled = kind == "adamw" or params.get("adam_w_mode", True)  # DeepSpeed's: Adam is AdamW unless told
    # torch.optim.AdamW (torch_adam) decays by 0.01 unless told; DeepSpeed's own Adams by 0
    default_decay = 0.01 if params.get("torch_adam", False) and decoupled else 0.0
    hp = dict(lr=params.get("lr", 1e-3), betas=tuple(params.get("betas", (0.9, 0.999))),
              eps=params.get("eps", 1e-8), weight_decay=params.get("weight_decay", default_decay))
    if not decoupled and hp["weight_decay"] != 0:
        raise ValueError("DeepSpeed config: optimizer Adam with adam_w_mode false and weight_decay "
                         f"{hp['weight_decay']} is Adam with L2 (the decay added to the grads, as torch.optim.Adam); "
                         "tiny_zero's AdamW decays decoupled: set adam_w_mode true or weight_decay 0")
    c.optimizer = hp
    settings = ", ".join(f"{k}={v}" for k, v in hp.items())
    c.changed.append(("optimizer", f"the strategy's AdamW({settings}), decoupled weight decay"))


def read_scheduler(section, c):
    if section is None:
        return
    sort_keys(section, SCHEDULER, "scheduler.", c)
    kind = section.get("type")
    if kind not in SCHEDULER_PARAMS:
        raise ValueError(f"DeepSpeed config: scheduler.type {kind!r} is not supported by tiny_zero "
                         f"({', '.join(SCHEDULER_PARAMS)})")
    params = section.get("params", {})
    sort_keys(params, dict.fromkeys(SCHEDULER_PARAMS[kind], READ), "scheduler.params.", c)
    if kind != "WarmupLR" and "total_num_steps" not in params:
        raise ValueError(f"DeepSpeed config: scheduler {kind} needs params.total_num_steps")
    c.scheduler = (kind, dict(params))
    c.changed.append(("scheduler", f"{kind}: sets the lr of each step (tiny_zero/lr_schedules.py)"))
