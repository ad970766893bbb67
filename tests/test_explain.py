"""python -m tiny_zero.explain as people run it: from any directory, with tiny_zero importable
but the checkout's example/ not (as after pip install -e .), on a saved Hugging Face model of
any vocabulary."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 3},
          "bf16": {"enabled": True}}


def explain(tmp_path, model):
    """The output of `python -m tiny_zero.explain` run in an empty directory; tiny_zero found
    through a link, the way an installed package is, so that `import example` fails there."""
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    site.mkdir(exist_ok=True)
    elsewhere.mkdir(exist_ok=True)
    if not (site / "tiny_zero").exists():
        (site / "tiny_zero").symlink_to(ROOT / "tiny_zero")
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-m", "tiny_zero.explain", str(tmp_path / "ds.json"), "--model", model,
                           "--world", "2"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_explain_runs_from_any_directory_on_a_small_vocabulary_hf_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "llama"
    transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2).save_pretrained(directory)
    out = explain(tmp_path, f"hf:{directory}")
    assert "strategy: tiny_zero.fsdp" in out
    assert "(Ψ = 6,224)" in out  # 2 x 32 x 16 (embedding and head) + 2 layers of 2,592 + the last norm's 16
    assert "strategy: tiny_zero.fsdp" in explain(tmp_path, "tiny")  # an example model, from elsewhere too


def test_explain_says_which_modules_train_through_hooks():
    """explain's line on how each module with parameters is reached: tiny_zero's
    layers, and the modules trained through hooks, by class (tests/hooked_checks.py's Net)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hooked_checks import Net

    from tiny_zero.explain import ways_line
    assert ways_line(Net()) == ("layers: 3 of tiny_zero's (Linear x3); 8 through module hooks (Conv2d x1, "
                                "BatchNorm2d x1, ScaledLinear x1, Scale x1, MultiheadAttention x2, OwnNorm x2)")
