"""DeepSpeed's engine over tiny_zero's wrappers: a DeepSpeed script runs unchanged.

    import tiny_zero as deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                                                config="ds_config.json")
    for x, y in batches:
        loss = engine(x, y)         # the module's forward
        engine.backward(loss)       # the loss / gradient_accumulation_steps; stages 2, 3: into the shard
        engine.step()               # at the accumulation boundary: clip, AdamW step, zero_grad, lr schedule

The engine holds the strategy's wrapper (RUNS[config.strategy], as tiny_zero.STRATEGIES)
and its AdamW, and adds nothing to the numbers: what each key of the config
sets is in tiny_zero/config.py, and docs/deepspeed.md says which lines of which
folder do it.
"""
import json
import logging
import os
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from . import agreements, checkpoint
from .client_optimizer import rebind_scheduler, take_client_optimizer
from .config import DTYPES, load_json, read_config
from .ddp import DDP, DDPAdamW
from .distributed import init_distributed
from .fsdp import FSDP, FSDPAdamW
from .fsdp.optim import FSDPOffloadAdamW
from .fsdp.wrapper import FSDPOffload
from .lr_schedules import SCHEDULES
from .offload import ZeroOffload, ZeroOffloadAdamW
from .precision import LossScaler
from .zero1 import Zero1, Zero1AdamW
from .zero2 import Zero2, Zero2AdamW

log = logging.getLogger("tiny_zero")
LATEST = "latest"  # save_dir/latest names the last tag saved, as DeepSpeed's
# config.strategy -> (wrapper, optimizer): the strategies a DeepSpeed config can name (tiny_zero/config.py)
RUNS = {"ddp": (DDP, DDPAdamW), "zero1": (Zero1, Zero1AdamW), "zero2": (Zero2, Zero2AdamW),
        "fsdp": (FSDP, FSDPAdamW), "offload": (ZeroOffload, ZeroOffloadAdamW)}


def strategy_classes(settings):
    """(wrapper, optimizer) for the config: RUNS[settings.strategy]; stage 3
    with offload_optimizer is fsdp with its optimizer on the host (tiny_zero/offload)."""
    if settings.strategy == "fsdp" and settings.offload_optimizer:
        return FSDPOffload, FSDPOffloadAdamW
    return RUNS[settings.strategy]


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """DeepSpeed's initialize, its arguments in its order: returns (engine, optimizer, dataloader, lr_scheduler).
    `config` (or config_params, args.deepspeed_config, args.deepscale_config): DeepSpeed's JSON config, a dict
    or a path. distributed_port has no effect: the process group comes from torchrun's environment."""
    if mpu is not None or mesh_param is not None:
        raise ValueError("tiny_zero.initialize: mpu and mesh_param (model-parallel groups) are not supported: the "
                         "engine is data parallel over every rank (tiny_zero.tensor and tiny_zero.pipeline are apart)")
    given = (config, config_params, getattr(args, "deepspeed_config", None), getattr(args, "deepscale_config", None))
    config = next((c for c in given if c is not None), None)
    if config is None or model is None:
        raise ValueError("tiny_zero.initialize needs model= and config= (a dict or a JSON file), "
                         "or args.deepspeed_config")
    if dist_init_required is False and not dist.is_initialized():
        raise RuntimeError("tiny_zero.initialize: dist_init_required=False, but no process group is initialised; "
                           "call tiny_zero.init_distributed() first, or leave dist_init_required out")
    rank, world_size = init_distributed()
    raw = load_json(config)
    agreements.open_side_channel()  # a rank given another config would wait forever at the first collective: check first
    agreements.agree("the DeepSpeed config", config=agreements.value_hash(json.dumps(raw, sort_keys=True, default=str)))
    settings = read_config(raw, world_size)
    if optimizer is not None and settings.optimizer:
        settings.no_effect.append(("optimizer", "a client optimizer was given, which DeepSpeed steps too"))
    if rank == 0:
        for key, why in settings.no_effect:
            print(f"tiny_zero: {key} has no effect here: {why}")
    engine = Engine(model, settings, model_parameters, lr_scheduler, optimizer)
    loader = None
    if training_data is not None:
        loader = data_loader(training_data, settings, rank, world_size, collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def add_config_arguments(parser):
    """DeepSpeed's: --deepspeed and --deepspeed_config (and their old names, --deepscale and
    --deepscale_config) on an argparse parser; initialize reads args.deepspeed_config."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="run through the engine")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the DeepSpeed JSON config")
    group.add_argument("--deepscale", default=False, action="store_true", help="the old name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="the old name of --deepspeed_config")
    return parser


def data_loader(dataset, settings, rank, world_size, collate_fn=None):
    """DeepSpeed's: each rank its share of the dataset (shuffled, as DistributedSampler), micro-batches,
    put together by collate_fn (torch's default_collate when None)."""
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    return torch.utils.data.DataLoader(dataset, batch_size=settings.micro_batch, sampler=sampler,
                                       drop_last=settings.drop_last, collate_fn=collate_fn)


class StaticLossScaler(LossScaler):
    """fp16 with a fixed loss_scale: an overflow still skips the step, as DeepSpeed's; the scale never moves."""

    def update(self, overflow):
        self.iteration += 1


class Engine(nn.Module):
    """DeepSpeed's engine: forward, backward, step, checkpoints; around a tiny_zero wrapper."""

    def __init__(self, module, settings, model_parameters=None, lr_scheduler=None, client_optimizer=None):
        super().__init__()
        self.settings = settings
        params = list(model_parameters) if model_parameters is not None else None
        wrapper_class = strategy_classes(settings)[0]
        self.wrapper = wrapper_class(module, loss_scaler=loss_scaler(settings), **settings.wrapper_options())
        self.optimizer, client = self.make_optimizer(params, client_optimizer)
        self.lr_scheduler = make_scheduler(settings, self.optimizer, lr_scheduler, client)
        self.global_steps = 0  # optimizer steps, skipped ones too (as DeepSpeed counts them)
        self.micro_steps = 0
        self.step_applied = False
        self.global_grad_norm = None  # the last step's, before clipping: a tensor, read only when asked

    def make_optimizer(self, params, client):
        """(the strategy's AdamW, the client's optimizer or None): from the client's
        optimizer when given (DeepSpeed steps that one then), else from the config's."""
        optimizer_class = strategy_classes(self.settings)[1]
        if client is None:
            if not self.settings.optimizer:
                raise ValueError("tiny_zero.initialize: no optimizer: the config has no \"optimizer\" and "
                                 "optimizer= is None; give one of them")
            return optimizer_class(self.wrapper, params, **self.settings.optimizer), None
        client, defaults, groups = take_client_optimizer(client, params)
        return optimizer_class(self.wrapper, groups, **defaults), client

    @property
    def module(self):
        return self.wrapper.module

    @property
    def device(self):
        return self.wrapper.device

    @property
    def global_rank(self):
        return self.wrapper.rank

    @property
    def world_size(self):
        return self.wrapper.world_size

    def forward(self, *inputs, **kwargs):
        return self.wrapper(*inputs, **kwargs)

    def train_batch_size(self):
        return self.settings.train_batch_size

    def train_micro_batch_size_per_gpu(self):
        return self.settings.micro_batch

    def gradient_accumulation_steps(self):
        return self.settings.accumulation

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self.settings.accumulation == 0

    def get_lr(self):
        return [group["lr"] for group in self.optimizer.param_groups]

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """loss / gradient_accumulation_steps, backward. As DeepSpeed's: at stages 2 and 3 every
        micro-step reduce-scatters its grads into this rank's shard, where they add up, so that a rank
        holds 1/N of the grads between micro-steps; at stages 0 and 1 the micro-steps before the
        boundary keep the full grads (no_sync) and the boundary's backward averages their sum."""
        if scale_wrt_gas and self.settings.accumulation > 1:
            loss = loss / self.settings.accumulation
        local = self.settings.stage < 2 and not self.is_gradient_accumulation_boundary()
        quiet = self.wrapper.no_sync() if local else nullcontext()
        with quiet:
            loss.backward(retain_graph=retain_graph)
        return loss

    def step(self):
        """At the boundary: clip (the norm is kept for get_global_grad_norm), step, zero the grads,
        and step the lr schedule unless fp16 skipped the step. Every micro-step counts."""
        self.step_applied = False
        if self.is_gradient_accumulation_boundary():
            skipped = self.optimizer.skipped_steps
            # DeepSpeed's ZeRO optimizers compute the norm at every step, clipping or not; inf clips nothing
            self.global_grad_norm = self.wrapper.clip_grad_norm_(self.settings.clip or float("inf"))
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.step_applied = self.optimizer.skipped_steps == skipped
            if self.lr_scheduler is not None and self.step_applied:
                with warnings.catch_warnings():  # torch's: the schedule's optimizer.step was replaced (by ours)
                    warnings.filterwarnings("ignore", "Seems like `optimizer.step()` has been overridden")
                    self.lr_scheduler.step()
            self.global_steps += 1
        self.micro_steps += 1

    def was_step_applied(self):
        """The last step() stepped the optimizer: a boundary, and fp16 found no overflow."""
        return self.step_applied

    def get_global_grad_norm(self):
        """The grads' global norm at the last step, before clipping (None before the first)."""
        return None if self.global_grad_norm is None else float(self.global_grad_norm)

    def zero_optimization_stage(self):
        return self.settings.stage

    def fp16_enabled(self):
        return self.settings.mixed_precision == "fp16"

    def bfloat16_enabled(self):
        return self.settings.mixed_precision == "bf16"

    @property
    def local_rank(self):
        return int(os.environ.get("LOCAL_RANK", 0))

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        """The whole model's state_dict, in the training dtype (bf16, fp16, else fp32), to save_dir/save_filename
        on rank 0; a collective: every rank calls it. At any stage (DeepSpeed's stage 3 saves only with
        stage3_gather_16bit_weights_on_model_save)."""
        dtype = DTYPES[self.settings.mixed_precision or "fp32"]
        whole = {name: b for name, b in self.module.named_buffers() if not b.is_floating_point()}  # kept as they are
        frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
        full = {name: whole[name].detach().cpu().clone() if name in whole else value.to(dtype)
                for name, value in self.wrapper.full_state_dict().items()
                if not (exclude_frozen_parameters and name in frozen)}
        if self.wrapper.rank == 0:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            torch.save(full, Path(save_dir) / save_filename)
        dist.barrier()  # the file is there once this returns, on every rank
        return True

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        """tiny_zero's sharded checkpoint in save_dir/tag (every rank writes its part),
        with the engine's counters, the lr schedule and client_state."""
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        extra = {"client_state": client_state or {}, "micro_steps": self.micro_steps,
                 "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None}
        checkpoint.save(Path(save_dir) / tag, self.wrapper, self.optimizer, step=self.global_steps, extra=extra)
        if save_latest and self.wrapper.rank == 0:
            (Path(save_dir) / LATEST).write_text(tag)
        dist.barrier()  # every rank may read `latest` once this returns
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """Resume from save_checkpoint's directory: returns (path, client_state),
        or (None, None) when load_dir has no `latest` and no tag is given. As
        DeepSpeed's: load_optimizer_states=False leaves the optimizer as it is
        (moments, step counts, param groups, loss scale), and
        load_lr_scheduler_states=False the schedule; load_module_only=True
        loads the weights alone (the step counters stay too)."""
        if not load_module_strict or custom_load_fn is not None:
            raise ValueError("engine.load_checkpoint: load_module_strict=False and custom_load_fn are not supported "
                             "by tiny_zero: a checkpoint loads every tensor of the model, checked by name and shape")
        if tag is None:
            latest = Path(load_dir) / LATEST
            if not latest.is_file():
                log.warning("no %s file in %s: nothing loaded", LATEST, load_dir)
                return None, None
            tag = latest.read_text().strip()
        path = Path(load_dir) / str(tag)
        info = checkpoint.load(path, self.wrapper, self.optimizer,
                               optimizer_states=load_optimizer_states and not load_module_only)
        extra = info["extra"]
        if not load_module_only:
            self.global_steps, self.micro_steps = info["step"], extra["micro_steps"]
            if load_lr_scheduler_states and self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
                self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        return str(path), extra["client_state"]


def loss_scaler(settings):
    scale = settings.loss_scale
    if scale is None:
        return None
    if "static" in scale:
        return StaticLossScaler(init_scale=scale["static"])
    return LossScaler(**scale)


def make_scheduler(settings, optimizer, lr_scheduler, client=None):
    """The config's schedule; else the lr_scheduler argument, as DeepSpeed takes it: a callable of the
    optimizer, or a schedule built on the client's optimizer (it then sets the strategy's AdamW's lr)."""
    if settings.scheduler is not None:
        kind, params = settings.scheduler
        return SCHEDULES[kind](optimizer, **params)
    if lr_scheduler is None:
        return None
    if hasattr(lr_scheduler, "step"):
        return rebind_scheduler(lr_scheduler, client, optimizer)
    if not callable(lr_scheduler):
        raise ValueError("tiny_zero.initialize: lr_scheduler must be a schedule or a callable that takes the "
                         f"optimizer, got {type(lr_scheduler).__name__}")
    return lr_scheduler(optimizer)
