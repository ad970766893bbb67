"""DeepSpeed's JSON config, read into what tiny_zero runs (docs/deepspeed.md).

    config = read_config("ds_config.json", world_size=8)
    config.strategy        "ddp", "zero1", "zero2", "fsdp" or "offload"
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

STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}  # DeepSpeed's stage 3 slices every tensor, as fsdp does
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
READ = "read"  # the keys read_config() reads, each at its level

# Per level: {key: READ, or ("no effect", why), or ("refused", is_off(value), why)}. A refused key whose value
# is_off (its default: the feature switched off) is accepted as it changes nothing.
TOP = {
    "train_batch_size": READ, "train_micro_batch_size_per_gpu": READ, "gradient_accumulation_steps": READ,
    "optimizer": READ, "scheduler": READ, "gradient_clipping": READ, "fp16": READ, "bf16": READ,
    "zero_optimization": READ, "communication_data_type": READ,
    "steps_per_print": ("no effect", "DeepSpeed's progress log; the training script prints what it wants"),
    "wall_clock_breakdown": ("no effect", "DeepSpeed's timers; tiny_zero's are --trace (tiny_zero.measure.trace)"),
    "memory_breakdown": ("no effect", "DeepSpeed's memory log; tiny_zero's is tiny_zero.measure.memory"),
    "dump_state": ("no effect", "DeepSpeed's printout of its own state"),
    "flops_profiler": ("no effect", "a DeepSpeed profiler"),
    "tensorboard": ("no effect", "DeepSpeed's monitor"), "wandb": ("no effect", "DeepSpeed's monitor"),
    "csv_monitor": ("no effect", "DeepSpeed's monitor"), "comms_logger": ("no effect", "DeepSpeed's comm log"),
    "zero_allow_untested_optimizer": ("no effect", "tiny_zero steps its own AdamW only"),
    "zero_force_ds_cpu_optimizer": ("no effect", "offload steps tiny_zero's AdamW on the host, whatever this says"),
    "checkpoint": ("no effect", "how DeepSpeed writes checkpoints; tiny_zero's are sharded and reshard on load"),
    "activation_checkpointing": ("no effect", "configures deepspeed.checkpointing, which a model calls itself"),
    "aio": ("no effect", "NVMe transfers, which tiny_zero does not use"),
    "dataloader_drop_last": READ,
    "prescale_gradients": ("refused", lambda v: v is False, "grads divided before the all-reduce: rounding differs"),
    "gradient_predivide_factor": ("refused", lambda v: v == 1.0, "a split of the average around the all-reduce"),
    "sparse_gradients": ("refused", lambda v: v is False, "sparse embedding grads"),
    "amp": ("refused", lambda v: not v.get("enabled", False), "NVIDIA Apex AMP; use bf16 or fp16"),
    "data_types": ("refused", lambda v: v.get("grad_accum_dtype") in (None, "fp32"),
                   "grads accumulated in a dtype of their own"),
    "compression_training": ("refused", lambda v: not v, "quantization and pruning during training"),
    "data_efficiency": ("refused", lambda v: not v.get("enabled", False), "curriculum learning, data routing"),
    "curriculum_learning": ("refused", lambda v: not v.get("enabled", False), "curriculum learning"),
    "elasticity": ("refused", lambda v: not v.get("enabled", False), "elastic batch sizes"),
    "pipeline": ("refused", lambda v: not v, "DeepSpeed's pipeline engine (tiny_zero.pipeline is its own)"),
    "moe": ("refused", lambda v: not v, "mixture of experts"),
}
OPTIMIZER = {"type": READ, "params": READ}
ADAM = {
    "lr": READ, "betas": READ, "eps": READ, "weight_decay": READ, "adam_w_mode": READ, "torch_adam": READ,
    "bias_correction": ("refused", lambda v: v is True, "Adam without bias correction"),
    "amsgrad": ("refused", lambda v: v is False, "AMSGrad"),
    "foreach": ("no effect", "how torch.optim loops over tensors"),
    "fused": ("no effect", "how torch.optim loops over tensors"),
    "fp32_optimizer_states": ("refused", lambda v: v is True, "optimizer state in a low precision"),
}
SCHEDULER = {"type": READ, "params": READ}
SCHEDULER_PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "last_batch_iteration"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"),
}
FP16 = {
    "enabled": READ, "loss_scale": READ, "initial_scale_power": READ, "loss_scale_window": READ,
    "hysteresis": READ, "min_loss_scale": READ,
    "auto_cast": ("refused", lambda v: v is False, "inputs cast to fp16 by the engine"),
    "consecutive_hysteresis": ("refused", lambda v: v is False, "hysteresis restored after each good step"),
    "fp16_master_weights_and_grads": ("refused", lambda v: v is False, "fp16 master weights"),
}
BF16 = {
    "enabled": READ,
    "immediate_grad_update": ("no effect", "when DeepSpeed adds grads into its fp32 copy; tiny_zero reduces in "
                                           "the parameters' dtype and steps fp32 masters, as DeepSpeed's default"),
    "check_grad_overflow": ("no effect", "bf16 has fp32's range: tiny_zero never checks"),
    "bf16_master_weights_and_grads": ("refused", lambda v: v is False, "bf16 master weights"),
    "bf16_optimizer_states": ("refused", lambda v: v is False, "optimizer state in bf16"),
}
WHY_OVERLAP = "tiny_zero always overlaps: each bucket is sent as its last grad is ready"
ZERO = {
    "stage": READ, "offload_optimizer": READ, "reduce_bucket_size": READ,
    "allgather_bucket_size": ("no effect", "tiny_zero all-gathers the same buckets reduce_bucket_size cuts"),
    "overlap_comm": ("no effect", WHY_OVERLAP),
    "contiguous_gradients": ("no effect", "tiny_zero's grads always live in flat buckets"),
    "reduce_scatter": ("no effect", "tiny_zero reduce-scatters always; an all-reduce would give the same average"),
    "allgather_partitions": ("no effect", "tiny_zero all-gathers the updated shards always"),
    "round_robin_gradients": ("no effect", "an order of copies for speed"),
    "load_from_fp32_weights": ("no effect", "tiny_zero's checkpoints hold the fp32 masters and load them"),
    "elastic_checkpoint": ("no effect", "tiny_zero's checkpoints load at any world size"),
    "ignore_unused_parameters": ("no effect", "unused parameters get no step, as torch DDP's "
                                              "find_unused_parameters=True"),
    "use_multi_rank_bucket_allreduce": ("no effect", "an all-reduce schedule"),
    "stage3_prefetch_bucket_size": ("no effect", "fsdp prefetches the next unit (a block)"),
    "stage3_max_live_parameters": ("no effect", "fsdp frees each unit after use"),
    "stage3_max_reuse_distance": ("no effect", "fsdp frees each unit after use"),
    "stage3_param_persistence_threshold": ("no effect", "fsdp slices every tensor; keeping small ones whole "
                                                        "gives the same numbers"),
    "stage3_model_persistence_threshold": ("no effect", "as stage3_param_persistence_threshold"),
    "stage3_gather_16bit_weights_on_model_save": ("no effect", "engine.save_checkpoint writes tiny_zero's "
                                                               "sharded checkpoint; consolidate it for whole weights"),
    "sub_group_size": ("no effect", "the size of DeepSpeed's optimizer steps"),
    "memory_efficient_linear": ("no effect", "fsdp's layers free what they gathered anyway"),
    "zero_hpz_partition_size": ("no effect", "a second copy of the parameters within a node, for speed"),
    "offload_param": ("refused", lambda v: v.get("device", "none") == "none", "parameters in host memory "
                                                                              "(ZeRO-Infinity)"),
    "cpu_offload": ("refused", lambda v: v is False, "the old name: use offload_optimizer.device cpu"),
    "zero_quantized_weights": ("refused", lambda v: v is False, "quantized weights (ZeRO++)"),
    "zero_quantized_nontrainable_weights": ("refused", lambda v: v is False, "quantized weights (ZeRO++)"),
    "zero_quantized_gradients": ("refused", lambda v: v is False, "quantized gradients (ZeRO++)"),
    "mics_shard_size": ("refused", lambda v: v in (-1, None), "MiCS sharding groups"),
    "legacy_stage1": ("refused", lambda v: v is False, "DeepSpeed's old stage 1"),
}
OFFLOAD = {
    "device": READ,
    "pin_memory": ("no effect", "tiny_zero's host buffers are pinned when CUDA is there"),
    "buffer_count": ("no effect", "DeepSpeed's NVMe buffers"),
    "fast_init": ("no effect", "DeepSpeed's NVMe start"),
    "pipeline_read": ("no effect", "DeepSpeed's NVMe transfers"), "pipeline_write": ("no effect", "as pipeline_read"),
    "ratio": ("refused", lambda v: v == 1.0, "a part of the optimizer offloaded"),
    "nvme_path": ("refused", lambda v: v is None, "NVMe offload"),
}


@dataclass
class Config:
    world_size: int
    strategy: str = "ddp"
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
    drop_last: bool = False
    changed: list = field(default_factory=list)  # (key, what it does here)
    no_effect: list = field(default_factory=list)  # (key, why)

    def wrapper_options(self):
        """The keyword arguments of the strategy's wrapper (loss_scaler apart)."""
        options = {"mixed_precision": self.mixed_precision, "reduce_dtype": self.reduce_dtype}
        if self.bucket_elements is not None and self.strategy != "fsdp":
            options["bucket_bytes"] = self.bucket_bytes()
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
    raw = load_json(config)
    c = Config(world_size)
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


def sort_keys(section, known, prefix, c):
    """Check every key of `section` against `known`; note the no-effect ones, refuse the others."""
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
        if rule[0] == "no effect":
            c.no_effect.append((name, rule[1]))
        elif not rule[1](value):
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
        c.changed.append(("gradient_accumulation_steps", f"{acc}: engine.backward divides the loss by {acc}; "
                          f"the first {acc - 1} backward passes of a step run in model.no_sync()"))


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
    fp16, bf16 = without_auto(raw.get("fp16", {}), "fp16.", c), without_auto(raw.get("bf16", {}), "bf16.", c)
    sort_keys(fp16, FP16, "fp16.", c)
    sort_keys(bf16, BF16, "bf16.", c)
    fp16_on, bf16_on = flag(fp16, "enabled", "fp16."), flag(bf16, "enabled", "bf16.")
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
    zero = without_auto(zero, "zero_optimization.", c)
    sort_keys(zero, ZERO, "zero_optimization.", c)
    stage = zero.get("stage", 0)
    if stage not in STAGES:
        raise ValueError(f"DeepSpeed config: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    c.strategy = STAGES[stage]
    c.changed.append(("zero_optimization.stage", f"{stage}: tiny_zero.{c.strategy}"))
    offload = without_auto(zero.get("offload_optimizer", {}), "zero_optimization.offload_optimizer.", c)
    sort_keys(offload, OFFLOAD, "zero_optimization.offload_optimizer.", c)
    device = offload.get("device", "none")
    if device == "cpu":
        if stage not in (1, 2):
            raise ValueError(f"DeepSpeed config: offload_optimizer with stage {stage} is not supported by "
                             "tiny_zero: its offload is ZeRO-Offload's, on stage 2 (stage 1 gives the same numbers)")
        c.strategy = "offload"
        c.changed.append(("zero_optimization.offload_optimizer.device", "cpu: tiny_zero.offload (fp32 masters and "
                          "AdamW in host memory)"))
    elif device != "none":
        raise ValueError(f"DeepSpeed config: zero_optimization.offload_optimizer.device = {device!r} is not "
                         "supported by tiny_zero (only 'cpu' or 'none')")
    if "reduce_bucket_size" in zero:
        c.bucket_elements = int(zero["reduce_bucket_size"])
        if c.strategy == "fsdp":
            c.no_effect.append(("zero_optimization.reduce_bucket_size", "fsdp reduce-scatters one unit (a block) "
                                "at a time"))
        else:
            c.changed.append(("zero_optimization.reduce_bucket_size", f"{c.bucket_elements:,} elements: "
                              f"bucket_bytes={c.bucket_bytes():,}"))


def read_optimizer(section, c):
    if section is None:
        raise ValueError("DeepSpeed config: no optimizer; tiny_zero.initialize builds its AdamW from the "
                         "config's \"optimizer\" (type Adam or AdamW)")
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
