"""tiny_zero.initialize with DeepSpeed's config: the same losses as DeepSpeed, resume, and clear errors.

One spawned world of 2 runs every config through deepspeed.initialize (on
the CPU, torch.optim's AdamW inside) and through tiny_zero.initialize, the
resume check and the bad configs. Without deepspeed the comparisons skip.
"""
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT))
from harness import run_checks  # noqa: E402

import deepspeed_checks as checks  # noqa: E402
from tiny_zero.config import read_config  # noqa: E402
from tiny_zero.lr_schedules import SCHEDULES  # noqa: E402

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NO_DEEPSPEED = "deepspeed is not installed (pip install deepspeed): the comparison with it cannot run"
FP32_ATOL, BF16_ATOL = 4e-6, 2e-2
RUNS = {**checks.CONFIGS, **{name: cfg for name, (cfg, _) in checks.CLIENTS.items()}}

BAD = {  # name: (config, what the error must say)
    "batch": (checks.config(0, train_batch_size=10, gradient_accumulation_steps=2),
              "train_batch_size (10) must equal train_micro_batch_size_per_gpu (2) * gradient_accumulation_steps (2)"),
    "misspelt": (checks.config(0, gradient_cliping=1.0), "did you mean 'gradient_clipping'"),
    "misspelt_nested": (checks.config(0, zero={"overlap_com": True}), "did you mean 'zero_optimization.overlap_comm'"),
    "offload_param": (checks.config(3, zero={"offload_param": {"device": "cpu"}}), "zero_optimization.offload_param"),
    "optimizer": (dict(checks.config(0), optimizer={"type": "Lamb", "params": {}}), "optimizer.type 'Lamb'"),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    plan = [(("resume", name), "resume", (str(tmp_path_factory.mktemp("ds_checkpoint")), name))
            for name in checks.RESUMED]
    plan += [("bad", "bad_configs", ({name: cfg for name, (cfg, _) in BAD.items()},)),
             ("comm", "comm_names", ()), ("bad_clients", "bad_clients", ())]
    if HAS_DEEPSPEED:
        plan.append(("compare", "compare", (list(RUNS),)))
        plan.append(("partial", "partial_loads", (str(tmp_path_factory.mktemp("partial")),)))
        plan.append(("api", "engine_api", (str(tmp_path_factory.mktemp("api")),)))
        plan.append(("accumulation", "accumulation", ()))
    return run_checks(2, "deepspeed_checks", plan, timeout=600)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
@pytest.mark.parametrize("name", list(RUNS))
@pytest.mark.slow  # the spawned world of 2, with DeepSpeed: about 20 s
def test_every_micro_step_loss_matches_deepspeed(world, name):
    """The configs of deepspeed_checks.py, and CLIENTS': configs without an optimizer, run with the script's
    own torch.optim.AdamW or Adam (param groups, a schedule object), as DeepSpeed takes them."""
    settings = read_config(RUNS[name], 2)
    atol = BF16_ATOL if settings.mixed_precision == "bf16" else FP32_ATOL
    for rank, runs in enumerate(world["compare"]):
        ours, theirs = runs[name]["tiny_zero"][0], runs[name]["deepspeed"][0]
        assert len(ours) == len(theirs) == checks.STEPS * settings.accumulation
        assert ours == pytest.approx(theirs, abs=atol), (rank, ours, theirs)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
@pytest.mark.slow  # the spawned world of 2, with DeepSpeed: about 20 s
def test_clipping_moves_the_losses_more_than_the_tolerance(world):
    """Else a missing clip would pass the comparison."""
    runs = world["compare"][0]
    plain, clipped = runs["stage0"]["tiny_zero"][0], runs["stage0_clip"]["tiny_zero"][0]
    assert max(abs(a - b) for a, b in zip(plain, clipped)) > 10 * FP32_ATOL


@pytest.mark.parametrize("name", list(checks.RESUMED))
@pytest.mark.slow  # the spawned world of 2, with DeepSpeed: about 20 s
def test_save_and_load_checkpoint_resume_the_uninterrupted_run(world, name):
    for result in world["resume", name]:
        assert result["resumed"] == result["whole"]
        assert result["client_state"] == {"epoch": 3}
        assert result["path"].endswith("global_step2")
        global_steps, micro_steps, schedule_step, lr = result["counters"]
        assert (global_steps, micro_steps, schedule_step) == (2, 4, 1)
        assert lr == [pytest.approx(2e-2)]  # WarmupDecayLR after 2 steps of warmup


@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
@pytest.mark.parametrize("name", list(checks.PARTIAL))
@pytest.mark.slow  # the spawned world of 2, with DeepSpeed: about 20 s
def test_load_checkpoint_flags_load_what_deepspeeds_load(world, name):
    """load_optimizer_states, load_lr_scheduler_states and load_module_only:
    the counters, the lr and the losses after the load are DeepSpeed's."""
    for result in world["partial"]:
        (ds_steps, ds_lr, ds_losses), (steps, lr, losses) = result["deepspeed", name], result["tiny_zero", name]
        assert steps == ds_steps and lr == pytest.approx(ds_lr, rel=1e-6)
        assert max(abs(a - b) for a, b in zip(losses, ds_losses)) < FP32_ATOL, (losses, ds_losses)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
@pytest.mark.slow  # the spawned world of 2, with DeepSpeed: about 20 s
def test_engine_api_answers_as_deepspeeds(world):
    """zero_optimization_stage, fp16_enabled, bfloat16_enabled, local_rank, was_step_applied and
    get_global_grad_norm at every micro-step, and the weights save_16bit_model writes."""
    for rank, result in enumerate(world["api"]):
        ours, theirs = result["tiny_zero"], result["deepspeed"]
        assert ours["flags"] == theirs["flags"] == (3, False, False, rank, True)
        assert [applied for applied, _ in ours["steps"]] == [False, True, False, True]
        assert [applied for applied, _ in theirs["steps"]] == [False, True, False, True]
        for (_, norm), (_, their_norm) in zip(ours["steps"][1::2], theirs["steps"][1::2]):
            assert norm == pytest.approx(float(their_norm), rel=1e-5) and norm > 0.1  # above the clip (DeepSpeed: a 0-d tensor)
        assert ours["weights"].keys() == theirs["weights"].keys()
        for key, value in ours["weights"].items():
            assert value.dtype == theirs["weights"][key].dtype
            assert torch.allclose(value, theirs["weights"][key], atol=1e-5), key


@pytest.mark.slow  # the spawned world of 2, with DeepSpeed: about 20 s
def test_deepspeed_comm_names_and_loader_collate_fn(world):
    for rank, result in enumerate(world["comm"]):
        assert result["rank"] == (rank, 2, rank)
        assert result["sums"] == (3.0, 2.0)
        assert result["loader"] == [("collated", checks.MICRO)] * 2  # 4 of the 8 items here, 2 per micro-batch
        assert result["bf16"] == (True, False, 2)


@pytest.mark.slow  # the spawned world of 2, with DeepSpeed: about 20 s
def test_client_optimizers_that_cannot_be_taken_are_refused_by_name(world):
    for errors in world["bad_clients"]:
        assert "torch.optim.sgd.SGD is not supported" in errors["sgd"]
        assert "weight_decay 0.1, which torch's Adam adds to the grads" in errors["adam_l2"]
        assert "no optimizer" in errors["none"]


def test_add_config_arguments_and_initialize_without_a_process_group():
    import argparse

    import tiny_zero
    args = tiny_zero.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (True, "ds.json",
                                                                                            False, None)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="dist_init_required=False"):
            tiny_zero.initialize(model=checks.Net(), config=checks.config(0), dist_init_required=False)


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.slow  # the spawned world of 2, with DeepSpeed: about 20 s
def test_bad_config_raises_one_clear_error_on_every_rank(world, name):
    errors = [rank[name] for rank in world["bad"]]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert BAD[name][1] in errors[0], errors[0]


# ---------------------------------------------------------------- the config alone, no processes


@pytest.mark.parametrize("keys, expected", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, (16, 2, 2)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 4}, (16, 1, 4)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, (24, 2, 3)),
    ({"train_batch_size": 8}, (8, 2, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, (12, 3, 1)),
])
def test_any_two_batch_keys_imply_the_third(keys, expected):
    cfg = {**checks.config(0), **keys}
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key not in keys:
            del cfg[key]
    c = read_config(cfg, world_size=4)
    assert (c.train_batch_size, c.micro_batch, c.accumulation) == expected


def test_keys_map_to_the_strategy_and_its_settings():
    c = read_config(checks.config(2, zero={"reduce_bucket_size": 1000}, bf16={"enabled": True}), world_size=2)
    assert (c.strategy, c.mixed_precision) == ("zero2", "bf16")
    assert c.wrapper_options() == {"mixed_precision": "bf16", "reduce_dtype": None, "bucket_bytes": 2000}
    assert c.optimizer == {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    assert [read_config(checks.config(s), 2).strategy for s in range(4)] == ["ddp", "zero1", "zero2", "fsdp"]
    assert read_config(checks.config(1, zero=checks.OFFLOAD), 2).strategy == "offload"
    fp16 = read_config(checks.config(0, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 3}), 2)
    assert fp16.loss_scale == {"init_scale": 256.0, "window": 1000, "hysteresis": 3, "min_scale": 1}


def test_stage3_offload_is_fsdp_with_its_optimizer_and_parameters_on_the_host():
    """offload_optimizer at stage 3 picks FSDPOffload; offload_param with it sets offload_params;
    offload_param without it, or below stage 3, is refused by name, as offload_optimizer at stage 0."""
    from tiny_zero.engine import strategy_classes
    from tiny_zero.fsdp.optim import FSDPOffloadAdamW
    from tiny_zero.fsdp.wrapper import FSDPOffload
    c = read_config(checks.config(3, zero=checks.OFFLOAD), 2)
    assert (c.strategy, c.offload_optimizer, c.offload_params) == ("fsdp", True, False)
    assert strategy_classes(c) == (FSDPOffload, FSDPOffloadAdamW) and "offload_params" not in c.wrapper_options()
    params = {**checks.OFFLOAD, "offload_param": {"device": "cpu"}}
    assert read_config(checks.config(3, zero=params), 2).wrapper_options()["offload_params"] is True
    with pytest.raises(ValueError, match="offload_param.device = 'cpu' is supported by tiny_zero at stage 3"):
        read_config(checks.config(2, zero=params), 2)
    with pytest.raises(ValueError, match="offload_optimizer with stage 0 is not supported"):
        read_config(checks.config(0, zero=checks.OFFLOAD), 2)


def test_auto_and_words_are_read_as_deepspeed_reads_them():
    """DeepSpeed's pydantic sections drop "auto" (the default: fp32, stage 0)
    and read "false"/"true"; elsewhere "auto" is refused by name, not read."""
    auto = read_config(checks.config(2, zero={"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
                                     bf16={"enabled": "auto"}, fp16={"enabled": "auto"}), 2)
    assert (auto.strategy, auto.mixed_precision, auto.bucket_elements) == ("zero2", None, None)
    assert dict(auto.changed)["bf16.enabled"] == '"auto": the default, as DeepSpeed reads it'
    assert read_config(checks.config(0, bf16={"enabled": "false"}), 1).mixed_precision is None
    assert read_config(checks.config(0, bf16={"enabled": "true"}), 1).mixed_precision == "bf16"
    with pytest.raises(ValueError, match="bf16.enabled must be true or false"):
        read_config(checks.config(0, bf16={"enabled": "maybe"}), 1)
    cfg = checks.config(0)
    cfg["gradient_clipping"] = "auto"
    with pytest.raises(ValueError, match='gradient_clipping = "auto", which transformers'):
        read_config(cfg, 1)


def test_performance_keys_are_listed_with_why_they_change_nothing():
    c = read_config(checks.config(3, zero={"overlap_comm": True, "stage3_max_live_parameters": 10}), 2)
    noted = dict(c.no_effect)
    assert set(noted) == {"steps_per_print", "zero_optimization.overlap_comm",
                          "zero_optimization.stage3_max_live_parameters"}
    assert "overlaps" in noted["zero_optimization.overlap_comm"]


def test_adam_weight_decay_follows_deepspeed():
    def optimizer(**params):
        cfg = checks.config(0)
        cfg["optimizer"] = {"type": params.pop("type", "Adam"), "params": params}
        return read_config(cfg, 1).optimizer["weight_decay"]
    assert optimizer(torch_adam=True) == 0.01  # torch.optim.AdamW's default: DeepSpeed's Adam is AdamW
    assert optimizer(torch_adam=True, adam_w_mode=False) == 0.0  # torch.optim.Adam's
    assert optimizer() == 0.0  # DeepSpeed's FusedAdam and CPU Adam
    assert optimizer(adam_w_mode=False, weight_decay=0.0) == 0.0
    with pytest.raises(ValueError, match="Adam with L2"):
        optimizer(adam_w_mode=False, weight_decay=0.1)


SCHEDULE_PARAMS = {
    "WarmupLR": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 5},
    "WarmupDecayLR": {"total_num_steps": 12, "warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 4,
                      "warmup_type": "linear"},
    "WarmupCosineLR": {"total_num_steps": 12, "warmup_min_ratio": 0.1, "warmup_num_steps": 3,
                       "cos_min_ratio": 0.05},
}


@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
@pytest.mark.parametrize("kind", list(SCHEDULE_PARAMS))
def test_schedules_give_deepspeeds_learning_rates(kind, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import lr_schedules

    def lrs(schedule_class):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
        schedule, seen = schedule_class(opt, **SCHEDULE_PARAMS[kind]), []
        for _ in range(15):
            seen.append(opt.param_groups[0]["lr"])
            schedule.step()
        return seen
    ours, theirs = lrs(SCHEDULES[kind]), lrs(getattr(lr_schedules, kind))
    assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15) for a, b in zip(ours, theirs)), (ours, theirs)


def test_explain_prints_the_estimators_numbers(tmp_path, capsys):
    from example.model import build_model
    from tiny_zero import explain
    from tiny_zero.measure import estimate
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 16, "zero_optimization": {"stage": 3, "overlap_comm": true}, '
                    '"bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}')
    explain.main([str(path), "--model", "tiny", "--world", "8"])  # python -m tiny_zero.explain ...
    out = capsys.readouterr().out
    module = build_model("tiny", device="meta")
    held = estimate.model_state(module, "fsdp", 8, "bf16")[0]
    assert "tiny_zero.fsdp" in out and "tiny_zero/fsdp/" in out
    for category in estimate.CATEGORIES:
        assert f"{held[category]:,}" in out, (category, out)
    for kind, count in estimate.comm_per_step(module, "fsdp", 8, "bf16").items():
        assert f"{count * 2:,}" in out, (kind, out)
    assert "zero_optimization.overlap_comm" in out


def test_fp16_loss_scale_zero_is_dynamic_and_a_number_is_static():
    from tiny_zero.engine import StaticLossScaler, loss_scaler
    from tiny_zero.precision import LossScaler
    dynamic = loss_scaler(read_config(checks.config(0, fp16={"enabled": True, "loss_scale": 0}), 1))
    static = loss_scaler(read_config(checks.config(0, fp16={"enabled": True, "loss_scale": 128}), 1))
    assert type(dynamic) is LossScaler and dynamic.scale == 2.0**16
    assert isinstance(static, StaticLossScaler)
    for overflow in (True, True, True, False):
        static.update(overflow)
    assert static.scale == 128.0


def test_training_data_becomes_micro_batches_of_this_ranks_share():
    from tiny_zero.engine import data_loader
    settings = read_config(checks.config(0, dataloader_drop_last=True), 2)
    dataset = torch.utils.data.TensorDataset(torch.arange(10))
    batches = [b[0].tolist() for b in data_loader(dataset, settings, rank=1, world_size=2)]
    assert [len(b) for b in batches] == [checks.MICRO] * 2  # 5 of the 10: the last, short, batch dropped


@pytest.mark.slow  # the spawned world of 2, with DeepSpeed: about 20 s
@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
@pytest.mark.parametrize("stage", [2, 3])
def test_accumulation_keeps_the_grads_sharded_as_deepspeed(world, stage):
    """Between micro-steps a rank holds its shard of the grads (half of 404,736 bytes at world 2), no
    more than DeepSpeed; and the step sends what explain counts, its micro-steps included."""
    from tiny_zero import explain
    whole = 4 * sum(p.numel() for p in checks.Wide().parameters())
    settings = read_config(checks.config(stage, gradient_accumulation_steps=2), 2)
    sent = explain.step_collectives(checks.Wide(), settings, settings.bucket_bytes() if settings.bucket_elements
                                    else explain.estimate.DEFAULT_BUCKET_BYTES)
    for result in world["accumulation"]:
        (ours, calls), (theirs, _) = result["tiny_zero", stage], result["deepspeed", stage]
        assert ours <= theirs and ours <= whole / 2 * 1.01, (ours, theirs, whole)
        assert {kind: calls[kind] for kind in sent} == {kind: count for kind, (count, _) in sent.items()}
