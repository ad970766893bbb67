"""Worker functions for tests/test_deepspeed_config.py (run on every rank).

The same training loop, DeepSpeed's, runs through deepspeed.initialize and
through tiny_zero.initialize with the same config; every micro-step's loss is
recorded.
"""
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tiny_zero

VOCAB, WIDTH, HIDDEN, SEQ, MICRO, STEPS = 16, 12, 20, 5, 2, 5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x, y):
        logits = self.fc2(torch.tanh(self.fc1(self.ln(self.emb(x)))))
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def config(stage=0, eps=1e-8, **extra):
    """A DeepSpeed config both libraries read: torch.optim's AdamW inside DeepSpeed. eps=1 makes
    the update about lr * grad, so a grad off by a factor (a loss not divided by the
    accumulation steps) shows; Adam's usual eps hides it."""
    zero = {"stage": stage, **extra.pop("zero", {})}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": 10**9, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": eps,
                                                      "weight_decay": 0.1, "torch_adam": True}},
            **extra}


WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 2e-2, "warmup_num_steps": 3,
                                         "warmup_type": "linear"}}
DECAY = {"type": "WarmupDecayLR", "params": {"total_num_steps": STEPS, "warmup_min_lr": 1e-3,
                                             "warmup_max_lr": 2e-2, "warmup_num_steps": 2}}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
CONFIGS = {  # name: the config; each compared loss by loss
    "stage0": config(0),
    "stage0_clip": config(0, gradient_clipping=0.1),
    "stage1_accumulate": config(1, eps=1.0, gradient_accumulation_steps=2, scheduler=WARMUP),
    "stage2_clip_decay": config(2, gradient_clipping=0.1, scheduler=DECAY),
    "stage3_accumulate_clip": config(3, gradient_accumulation_steps=2, gradient_clipping=0.1, scheduler=DECAY),
    "stage2_accumulate": config(2, eps=1.0, gradient_accumulation_steps=2),
    "offload_clip": config(2, zero=OFFLOAD, gradient_clipping=0.1, zero_force_ds_cpu_optimizer=False),
    "offload_accumulate_bf16": config(2, zero=OFFLOAD, gradient_accumulation_steps=2, bf16={"enabled": True},
                                      zero_force_ds_cpu_optimizer=False),
    "bf16": config(2, bf16={"enabled": True}, gradient_clipping=0.1),
    "stage3_offload_accumulate_clip": config(3, zero=OFFLOAD, gradient_accumulation_steps=2, gradient_clipping=0.1,
                                             scheduler=DECAY, zero_force_ds_cpu_optimizer=False),
    "stage3_offload_params_bf16": config(3, zero={**OFFLOAD, "offload_param": {"device": "cpu"}},
                                         bf16={"enabled": True}, zero_force_ds_cpu_optimizer=False),
    "stage3_offload_params": config(3, zero={**OFFLOAD, "offload_param": {"device": "cpu"}},
                                    gradient_clipping=0.1, zero_force_ds_cpu_optimizer=False),
}


def batch(step):
    """This rank's micro-batch number `step`, the same in every run."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g), torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def train(engine, micro_steps, first=0):
    """DeepSpeed's loop; the loss of every micro-step."""
    losses = []
    for i in range(first, first + micro_steps):
        loss = engine(*batch(i))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def import_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    import deepspeed
    import deepspeed.ops
    deepspeed.utils.logger.setLevel("WARNING")
    # its shared-memory all-reduce compiles for a minute and serves inference only
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def adamw_groups(model):
    """A script's own optimizer: torch's AdamW over two param groups (no decay on the embedding and the
    norm; a higher lr on the rest), and a schedule object built on it."""
    groups = [{"params": [*model.emb.parameters(), *model.ln.parameters()], "weight_decay": 0.0},
              {"params": [*model.fc1.parameters(), *model.fc2.parameters()], "lr": 2e-2}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.99)), None


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05), None


def no_optimizer(stage, **extra):
    """A config without an "optimizer" section, as LLaMA-Factory's, axolotl's and DeepSpeed-Chat's."""
    cfg = config(stage, **extra)
    del cfg["optimizer"]
    return cfg


AUTO = {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold":
        "auto", "stage3_gather_16bit_weights_on_model_save": True}
# Configs in the shape their projects publish them. LLaMA-Factory's ds_z2_config.json, with the "auto"
# values that transformers' Trainer fills in (batch sizes, clipping, bf16 on); no optimizer: the Trainer's own.
LLAMA_FACTORY_Z2 = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                          "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                          "contiguous_gradients": True, "round_robin_gradients": True}}
# DeepSpeed-Chat's training config (its get_train_ds_config), stage 3 in bf16, no optimizer section.
DEEPSPEED_CHAT_Z3 = {
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10,
    "zero_optimization": {"stage": 3, "offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"},
                          "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e7,
                          "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False},
    "bf16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
    "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                      "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
    "tensorboard": {"enabled": False, "output_path": "step1_tensorboard/ds_tensorboard_logs/",
                    "job_name": "step1_model_tensorboard"}}
CLIENTS = {  # name: (config, the script's optimizer and schedule); each compared loss by loss with DeepSpeed
    "client_adamw_groups_stage1": (no_optimizer(1, gradient_accumulation_steps=2), "adamw_groups"),
    "client_adam_stage3_auto": (no_optimizer(3, zero=AUTO, bf16={"enabled": "auto"}, gradient_clipping=0.1),
                                "adam"),
    "client_adamw_offload_bf16": (no_optimizer(2, zero=OFFLOAD, bf16={"enabled": True}, gradient_clipping=0.1,
                                               zero_force_ds_cpu_optimizer=False), "adamw"),
    "llama_factory_z2": (LLAMA_FACTORY_Z2, "adamw_groups"),
    "deepspeed_chat_z3": (DEEPSPEED_CHAT_Z3, "adamw_groups"),
}


def run(library, cfg, client=None):
    """(losses, seconds of initialize) for `cfg` through `library`.initialize; `client`: the name of a
    function here that gives the script's own optimizer and schedule."""
    model = Net()
    optimizer, schedule = globals()[client](model) if client else (None, None)
    start = time.perf_counter()
    engine, _, _, _ = library.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                         lr_scheduler=schedule, config=copy.deepcopy(cfg))
    seconds = time.perf_counter() - start
    losses = train(engine, STEPS * engine.gradient_accumulation_steps())
    if hasattr(engine, "destroy"):
        engine.destroy()
    return losses, seconds


def compare(names):
    """{name: {"deepspeed": (losses, s), "tiny_zero": (losses, s)}} for CONFIGS[name] or CLIENTS[name]."""
    deepspeed = import_deepspeed()
    runs = {**{name: (cfg, None) for name, cfg in CONFIGS.items()}, **CLIENTS}
    return {name: {library.__name__: run(library, *runs[name]) for library in (deepspeed, tiny_zero)}
            for name in names}


RESUMED = {  # name: a config whose run resume() saves after 2 steps and resumes
    "stage2": config(2, gradient_accumulation_steps=2, gradient_clipping=0.1, scheduler=DECAY),
    "stage3_offload_params_bf16": config(3, zero={**OFFLOAD, "offload_param": {"device": "cpu"}},
                                         gradient_accumulation_steps=2, gradient_clipping=0.1, scheduler=DECAY,
                                         bf16={"enabled": True}),
}


def resume(directory, name="stage2"):
    """Losses of an uninterrupted run, and of one saved after 2 steps and resumed by a new engine;
    the client_state and counters that come back."""
    cfg = copy.deepcopy(RESUMED[name])
    whole, _ = run(tiny_zero, cfg)
    model = Net()
    engine, _, _, _ = tiny_zero.initialize(model=model, config=cfg)
    first = train(engine, 4)
    engine.save_checkpoint(directory, client_state={"epoch": 3})
    model = Net()
    engine, _, _, sched = tiny_zero.initialize(model=model, config=cfg)
    path, client_state = engine.load_checkpoint(directory)
    counters = (engine.global_steps, engine.micro_steps, sched.last_batch_iteration, engine.get_lr())
    rest = train(engine, 2 * STEPS - 4, first=4)
    return {"whole": whole, "resumed": first + rest, "client_state": client_state, "path": path,
            "counters": counters}


PARTIAL = {  # name: load_checkpoint's flags
    "no_optimizer_no_schedule": dict(load_optimizer_states=False, load_lr_scheduler_states=False),
    "no_schedule": dict(load_lr_scheduler_states=False),
    "module_only": dict(load_module_only=True),
}


def partial_loads(directory):
    """{(library, PARTIAL name): (global_steps, lr, the losses of 3 more steps)}: DeepSpeed's and
    tiny_zero's engines, saved after 2 steps and loaded by a new engine with those flags."""
    deepspeed = import_deepspeed()
    cfg = config(2, eps=1.0, scheduler=DECAY)
    out = {}
    for library in (deepspeed, tiny_zero):
        where = os.path.join(directory, library.__name__)
        model = Net()
        engine, _, _, _ = library.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))
        train(engine, 2)
        engine.save_checkpoint(where)
        for name, flags in PARTIAL.items():
            model = Net()
            engine, _, _, _ = library.initialize(model=model, model_parameters=model.parameters(),
                                                 config=copy.deepcopy(cfg))
            engine.load_checkpoint(where, **flags)
            out[library.__name__, name] = (engine.global_steps, engine.get_lr(), train(engine, 3, first=2))
    return out


def bad_configs(configs):
    """{name: the error tiny_zero.initialize raised for configs[name]}."""
    errors = {}
    for name, cfg in configs.items():
        model = Net()
        try:
            tiny_zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            errors[name] = None
        except Exception as e:  # noqa: BLE001 (the test reads the message)
            errors[name] = f"{type(e).__name__}: {e}"
    return errors


API = config(3, gradient_accumulation_steps=2, gradient_clipping=0.1,
             zero={"stage3_gather_16bit_weights_on_model_save": True})


def engine_api(directory):
    """{library: what DeepSpeed's engine API says}, after the same run of API: the stage, the
    precision flags, local_rank, was_step_applied and get_global_grad_norm at each micro-step, and the
    weights that save_16bit_model writes."""
    deepspeed = import_deepspeed()
    out = {}
    for library in (deepspeed, tiny_zero):
        model = Net()
        engine, _, _, _ = library.initialize(model=model, model_parameters=model.parameters(),
                                             config=copy.deepcopy(API), dist_init_required=False)
        steps = []
        for i in range(4):
            engine.backward(engine(*batch(i)))
            engine.step()
            steps.append((engine.was_step_applied(), engine.get_global_grad_norm()))
        path = os.path.join(directory, library.__name__)
        saved = engine.save_16bit_model(path, "weights.bin")
        dist.barrier()  # DeepSpeed's returns on rank 1 before rank 0 has written
        weights = torch.load(os.path.join(path, "weights.bin"))
        out[library.__name__] = {"flags": (engine.zero_optimization_stage(), engine.fp16_enabled(),
                                           engine.bfloat16_enabled(), engine.local_rank, saved),
                                 "steps": steps, "weights": {k: v.clone() for k, v in weights.items()}}
        if hasattr(engine, "destroy"):
            engine.destroy()
    return out


def comm_names():
    """DeepSpeed's deepspeed.comm calls, on tiny_zero.comm (and tiny_zero.init_distributed); a bf16
    engine's flags and saved dtype; a loader with a collate_fn."""
    comm = tiny_zero.comm
    tiny_zero.init_distributed()  # a group exists already: nothing happens
    total, top = torch.tensor([comm.get_rank() + 1.0]), torch.tensor([comm.get_rank() + 1.0])
    comm.all_reduce(total)
    comm.all_reduce(top, op=comm.ReduceOp.MAX)
    comm.barrier()
    model = Net()
    data = [(torch.zeros(SEQ, dtype=torch.long), torch.zeros(SEQ, dtype=torch.long))] * 8
    engine, _, loader, _ = tiny_zero.initialize(model=model, config=config(2, bf16={"enabled": True}),
                                                training_data=data, collate_fn=lambda items: ("collated", len(items)))
    return {"rank": (comm.get_rank(), comm.get_world_size(), comm.get_local_rank()),
            "sums": (total.item(), top.item()), "loader": list(loader),
            "bf16": (engine.bfloat16_enabled(), engine.fp16_enabled(), engine.zero_optimization_stage())}


def bad_clients():
    """{case: the error tiny_zero.initialize raised} for client optimizers it cannot take."""
    cases = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
             "adam_l2": lambda m: torch.optim.Adam(m.parameters(), weight_decay=0.1),
             "none": lambda m: None}
    errors = {}
    for name, make in cases.items():
        model = Net()
        cfg = config(2)
        del cfg["optimizer"]
        try:
            tiny_zero.initialize(model=model, optimizer=make(model), config=cfg)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return errors


class Wide(Net):
    """Net, wider: 101,184 parameters, so that a rank's grads (404,736 bytes whole) stand out."""

    def __init__(self):
        nn.Module.__init__(self)
        torch.manual_seed(0)
        self.emb, self.ln = nn.Embedding(VOCAB, 128), nn.LayerNorm(128)
        self.fc1, self.fc2 = nn.Linear(128, 512), nn.Linear(512, VOCAB * 4)


def grads_between_micro_steps(library, stage):
    """(bytes of grads a rank holds after the first micro-step of a step, {collective: calls} of the
    whole step). TensorMemory counts what the micro-step made and left alive, with the grad buffers
    that outlive a step (tiny_zero's shard; DeepSpeed's stage-3 flat partition) tracked before it."""
    from tiny_zero.measure.memory import TensorMemory
    model = Wide()
    engine, _, _, _ = library.initialize(model=model, model_parameters=model.parameters(),
                                         config=config(stage, gradient_accumulation_steps=2))
    train(engine, 2)  # a whole step first: what a step allocates once is there
    kept = list(engine.wrapper.grads.values()) if library is tiny_zero else [
        getattr(engine.optimizer, "grad_partitions_flat_buffer", None)]
    tiny_zero.comm.stats.reset()
    with TensorMemory() as memory:
        memory.track([t for t in kept if t is not None])
        train(engine, 1, first=2)
        held = memory.current
    train(engine, 1, first=3)
    if hasattr(engine, "destroy"):
        engine.destroy()
    return held, dict(tiny_zero.comm.stats.calls)


def accumulation():
    """{(library, stage): grads_between_micro_steps} at stages 2 and 3."""
    deepspeed = import_deepspeed()
    return {(library.__name__, stage): grads_between_micro_steps(library, stage)
            for stage in (2, 3) for library in (deepspeed, tiny_zero)}
