"""Every key that DeepSpeed 0.19 reads is accounted for by tiny_zero/config_keys.py, checked against
DeepSpeed's own config classes (no processes: the config alone)."""
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT))
import deepspeed_checks as checks  # noqa: E402
from tiny_zero import config_keys as keys  # noqa: E402
from tiny_zero.config import read_config  # noqa: E402

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NO_DEEPSPEED = "deepspeed is not installed (pip install deepspeed): its config classes cannot be read"


def deepspeeds_keys(monkeypatch):
    """{level: the keys DeepSpeed 0.19 reads there}: the top level as DeepSpeedConfig asks for its keys
    (a dict that records every key asked for), the sections as their pydantic models name them, aliases too."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import deepspeed.runtime.config as ds_config
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    class Asked(dict):
        asked = set()

        def get(self, key, *default):
            self.asked.add(key)
            return dict.get(self, key, *default)

        def __getitem__(self, key):
            self.asked.add(key)
            return dict.__getitem__(self, key)

        def __contains__(self, key):
            self.asked.add(key)
            return dict.__contains__(self, key)

        def keys(self):  # `key in config.keys()` is asked too
            return self
    # a world of one, so that DeepSpeedConfig reads sequence_parallel_size as under a launcher
    monkeypatch.setattr(ds_config, "dist", SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda *_: 1))
    ds_config.DeepSpeedConfig(Asked(train_batch_size=1))

    def fields(model):
        return {name for key, f in model.model_fields.items() for name in (key, f.alias) if name}
    return {"": Asked.asked, "zero_optimization.": fields(DeepSpeedZeroConfig) | set(ds_config._REMOVED_ZERO_CONFIG_KEYS),
            "zero_optimization.offload_optimizer.": fields(DeepSpeedZeroOffloadOptimizerConfig),
            "zero_optimization.offload_param.": fields(DeepSpeedZeroOffloadParamConfig),
            "fp16.": fields(DeepSpeedFP16Config), "bf16.": fields(DeepSpeedBF16Config)}


OURS = {"": keys.TOP, "zero_optimization.": keys.ZERO, "zero_optimization.offload_optimizer.": keys.OFFLOAD,
        "zero_optimization.offload_param.": keys.OFFLOAD_PARAM, "fp16.": keys.FP16, "bf16.": keys.BF16}
OLDER = {"moe"}  # keys of older DeepSpeeds that 0.19 no longer reads


@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
def test_every_key_deepspeed_reads_is_accounted_for(monkeypatch):
    """Each key DeepSpeed reads is read here, has a no-effect line, an alias, or a refusal with its reason."""
    theirs = deepspeeds_keys(monkeypatch)
    assert len(theirs[""]) > 50 and len(theirs["zero_optimization."]) > 40  # the spying worked
    for level, known in OURS.items():
        assert sorted(theirs[level] - set(known)) == [], level
        assert set(known) - theirs[level] <= OLDER, level


@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
def test_each_section_key_at_deepspeeds_default_reads_or_is_refused_by_name(monkeypatch):
    """A config holding a key at the value DeepSpeed defaults it to: read, or one ValueError that names it."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for section, model in (("zero", DeepSpeedZeroConfig), ("fp16", DeepSpeedFP16Config), ("bf16", DeepSpeedBF16Config)):
        for key, f in model.model_fields.items():
            default = None if f.is_required() else f.get_default(call_default_factory=True)
            default = default if isinstance(default, (bool, int, float, str, type(None))) else None
            for name in {key, f.alias} - {None}:
                cfg = checks.config(3 if section == "zero" else 0, **{section: {name: default}})
                try:
                    read_config(cfg, 2)
                except ValueError as e:
                    assert name in str(e), (name, str(e))


def test_real_keys_that_were_refused_are_read():
    def settings(**extra):
        return read_config(checks.config(**extra), 2)
    assert settings(bfloat16={"enabled": True}).mixed_precision == "bf16"  # DeepSpeed's other name of bf16
    assert settings(stage=2, zero={"cpu_offload": True}).strategy == "offload"
    assert settings(stage=2, zero={"offload_param": None, "offload_optimizer": None}).strategy == "zero2"
    assert settings(stage=3, zero={"stage3_gather_fp16_weights_on_model_save": True}).strategy == "fsdp"
    assert settings(stage=3, zero={"prefetch_bucket_size": 10}).strategy == "fsdp"
    assert "fp16.fp16_master_weights_and_grads" in dict(settings(fp16={"enabled": False,
                                                                       "fp16_master_weights_and_grads": True}).no_effect)
    for key in ("hybrid_engine", "compile", "torch_autocast", "sequence_parallel_size", "weight_quantization"):
        off = {"hybrid_engine": {"enabled": True}, "sequence_parallel_size": 1}.get(key, {})
        settings(**{key: off})
    for key in ("nebula", "eigenvalue", "progressive_layer_drop", "quantize_training"):
        with pytest.raises(ValueError, match=f"{key} .*DeepSpeed 0.19 has removed it too"):
            settings(**{key: {"enabled": True}})
    with pytest.raises(ValueError, match="zero_optimization.offload_param.device = 'cpu'"):
        settings(stage=3, zero={"offload_param": {"device": "cpu"}})


@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
def test_every_adam_parameter_deepspeed_passes_on_is_accounted_for(monkeypatch):
    """optimizer.params of type Adam or AdamW: DeepSpeed reads torch_adam, adam_w_mode and
    fp32_optimizer_states, and passes the rest to FusedAdam, DeepSpeedCPUAdam or torch's AdamW or Adam."""
    import inspect

    import torch
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    theirs = {"torch_adam", "adam_w_mode", "fp32_optimizer_states"}
    for optimizer in (FusedAdam, DeepSpeedCPUAdam, torch.optim.AdamW, torch.optim.Adam):
        theirs |= set(list(inspect.signature(optimizer.__init__).parameters)[2:])  # after self and the params
    theirs.discard("adamw_mode")  # DeepSpeedCPUAdam's, which DeepSpeed sets itself from adam_w_mode
    assert sorted(theirs - set(keys.ADAM)) == []
