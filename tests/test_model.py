"""The example models, GPT-2 and Llama: sizes, deterministic (meta) init, forward, training."""

import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch

from example.data import ByteData, load_text
from example.model import CONFIGS, GPT, GPTConfig, Llama, build_model, count_parameters


def expected_count(c: GPTConfig) -> int:
    """Parameter count from the architecture: tied head, biases on."""
    d = c.n_embd
    per_block = (
        2 * d  # ln_1
        + d * 3 * d + 3 * d  # c_attn
        + d * d + d  # attn.c_proj
        + 2 * d  # ln_2
        + d * 4 * d + 4 * d  # c_fc
        + 4 * d * d + d  # mlp.c_proj
    )
    return c.vocab_size * d + c.block_size * d + c.n_layer * per_block + 2 * d


@pytest.mark.parametrize(
    "name, count",
    [("gpt2", 124_475_904), ("gpt2-medium", 354_871_296), ("gpt2-large", 774_090_240), ("gpt2-xl", 1_557_686_400)],
)  # with vocab 50304; the often-quoted 774,030,080 and 1,557,611,200 are for vocab 50257
def test_gpt2_parameter_counts(name, count):
    model = build_model(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert count_parameters(model) == count == expected_count(CONFIGS[name])
    assert CONFIGS[name].vocab_size == 50304 and CONFIGS[name].block_size == 1024


def test_unpadded_vocab_gives_the_published_gpt2_sizes():
    published = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}
    for name, count in published.items():
        assert expected_count(replace(CONFIGS[name], vocab_size=50257)) == count


def test_small_configs():
    for name in ("tiny", "small"):
        model = build_model(name)
        assert model.config.vocab_size == 256
        assert count_parameters(model) == expected_count(CONFIGS[name])


def test_only_embedding_layernorm_linear_hold_parameters():
    model = build_model("tiny")
    for module in model.modules():
        if list(module.parameters(recurse=False)):
            assert type(module) in (torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.Linear), type(module)


def test_unknown_name_and_overrides():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("gpt5")
    model = build_model("tiny", n_layer=3, dropout=0.1)
    assert len(model.blocks) == 3 and model.config.dropout == 0.1
    assert CONFIGS["tiny"].n_layer == 2  # the registry entry is untouched


def test_tied_weights_share_storage():
    model = build_model("tiny")
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names


def test_init_rule():
    model = build_model("gpt2", device="meta")  # only names and shapes are used
    cfg = CONFIGS["tiny"]
    tiny = build_model("tiny")
    params = dict(tiny.named_parameters())
    assert torch.equal(params["ln_f.weight"], torch.ones(cfg.n_embd))
    assert torch.equal(params["blocks.0.ln_1.bias"], torch.zeros(cfg.n_embd))
    assert torch.equal(params["blocks.1.attn.c_attn.bias"], torch.zeros(3 * cfg.n_embd))
    # std of a big tensor is close to the rule's value
    t = torch.empty(768 * 3072)
    model.init_parameter("blocks.3.mlp.c_fc.weight", t)
    assert t.std().item() == pytest.approx(0.02, rel=0.02)
    model.init_parameter("blocks.3.mlp.c_proj.weight", t)
    assert t.std().item() == pytest.approx(0.02 / math.sqrt(2 * 12), rel=0.02)
    model.init_parameter("blocks.3.attn.c_proj.weight", t)
    assert t.std().item() == pytest.approx(0.02 / math.sqrt(2 * 12), rel=0.02)


def test_meta_init_matches_normal_build():
    reference = build_model("tiny", seed=3)
    with torch.device("meta"):
        model = GPT(CONFIGS["tiny"], seed=3)
    assert all(p.is_meta for p in model.parameters())
    for name, p in model.named_parameters():
        t = torch.empty(p.shape, dtype=p.dtype)
        model.init_parameter(name, t)
        assert torch.equal(t, dict(reference.named_parameters())[name]), name
    # a default-device context (e.g. torch.device("cuda")) does not change the values
    t = torch.empty(reference.wpe.weight.shape)
    with torch.device("meta"):
        model.init_parameter("wpe.weight", t)
    assert torch.equal(t, reference.wpe.weight)
    # the tied head gets the embedding's values too
    t = torch.empty_like(reference.wte.weight)
    model.init_parameter("lm_head.weight", t)
    assert torch.equal(t, reference.wte.weight)


def test_init_depends_on_seed_and_name_and_fills_other_dtypes():
    a, b, c = build_model("tiny", seed=0), build_model("tiny", seed=0), build_model("tiny", seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
        if name.endswith("weight") and "ln_" not in name:
            assert not torch.equal(pa, pc), name
    w = dict(a.named_parameters())
    assert not torch.equal(w["blocks.0.mlp.c_fc.weight"], w["blocks.1.mlp.c_fc.weight"])
    t = torch.empty(w["wpe.weight"].shape, dtype=torch.bfloat16)
    a.init_parameter("wpe.weight", t)
    assert torch.equal(t, w["wpe.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("name, count", [("llama-1b", 1_235_814_400), ("llama-8b", 8_030_261_248)])
def test_llama_parameter_counts(name, count):
    """The published sizes of Llama 3.2 1B (tied head) and Llama 3.1 8B."""
    model = build_model(name, device="meta")
    assert isinstance(model, Llama) and count_parameters(model) == count


def test_llama_meta_init_matches_normal_build_and_the_head_is_tied():
    reference = build_model("llama-tiny", seed=3)
    model = build_model("llama-tiny", seed=3, device="meta")
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    for name, p in model.named_parameters():
        t = torch.empty(p.shape)
        model.init_parameter(name, t)
        assert torch.equal(t, dict(reference.named_parameters())[name]), name
    params = dict(reference.named_parameters())
    assert torch.equal(params["model.layers.1.post_attention_layernorm.weight"], torch.ones(64))
    t = torch.empty(4096 * 4096)
    build_model("llama-8b", device="meta").init_parameter("model.layers.3.mlp.down_proj.weight", t)
    assert t.std().item() == pytest.approx(0.02 / math.sqrt(2 * 32), rel=0.02)


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_forward_shapes_and_initial_loss(name):
    cfg = CONFIGS[name]
    model = build_model(name)
    idx = torch.randint(0, 256, (3, cfg.block_size), generator=torch.Generator().manual_seed(0))
    logits = model(idx)
    assert logits.shape == (3, cfg.block_size, 256)
    assert model(idx[:, :10]).shape == (3, 10, 256)
    loss = model(idx, idx.roll(-1, dims=1))
    assert loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_training_lowers_loss(name):
    torch.manual_seed(0)
    model = build_model(name)
    data = ByteData(load_text(), seq_len=64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        x, y = data.get_batch("train", 8, step)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_activation_checkpointing_same_loss_and_grads(name):
    plain = build_model(name)
    ckpt = build_model(name, checkpoint_activations=True)
    x, y = ByteData(load_text(), seq_len=64).get_batch("train", 4, 0)
    losses = []
    for model in (plain, ckpt):
        loss = model(x, y)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_dropout_only_when_asked():
    assert not any(isinstance(m, torch.nn.Dropout) for m in build_model("tiny").modules())
    model = build_model("tiny", dropout=0.5)
    assert any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    x = torch.randint(0, 256, (2, 16))
    model.eval()
    assert torch.equal(model(x), model(x))
