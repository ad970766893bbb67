"""Hugging Face models, built here from tiny configs (nothing is downloaded;
save_pretrained to a temporary directory stands in for a download).

- Each class tiny_zero adapts (transformers' Conv1D, RMSNorm classes,
  T5LayerNorm, Gemma's and OPT's embeddings) computes what the original
  computes: outputs and grads, fp32, bf16 and mixed.
- Whole models convert and equal the original: Llama, Qwen2/3, Mistral,
  Gemma, GPT-2, BERT (its aliased bias), OPT, Phi-3, T5; Mixtral's experts
  and ViT's embeddings keep their class, for a strategy's hooks.
- Llama, Qwen2 (tied head) and GPT-2 trained by every strategy on 2 and 3
  ranks equal single-process torch over 4 AdamW steps (eps=1); Gemma (its
  scaled embedding tied to the head), OPT, Phi-3 and T5 trained by zero3 and
  fsdp on 2 ranks too.
- Fine-tuning as transformers users write it (padding, attention mask,
  labels -100, labels= loss, gradient checkpointing) equals torch too.
- load_pretrained: a saved model (one safetensors file, an index of shards,
  a torch state_dict file) loads into every strategy, also built on meta,
  and its outputs equal the original's; files that do not fit raise the same
  clear error on every rank and change nothing.
- A checkpoint consolidated to safetensors loads with from_pretrained.
- The examples train a saved Llama with --model hf:DIR.
"""
import copy
import importlib
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

sys.path.insert(0, str(Path(__file__).parent))

import hf_checks  # noqa: E402
from harness import run_checks  # noqa: E402
from tiny_zero.checkpoint import load_pretrained  # noqa: E402
from tiny_zero.checkpoint.consolidate import main as consolidate_main  # noqa: E402
from tiny_zero.materialize import meta_parameters  # noqa: E402
from tiny_zero.module import FOREIGN, CallbackLayer, Conv1D, swap_layers  # noqa: E402
from tiny_zero.module.swap import qualified_name  # noqa: E402

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
MODELS = ["llama", "qwen2", "gpt2"]
# trained by the strategies that release parameters outside a layer's forward:
# each has a layer that keeps its own forward (Gemma's tied, scaled embedding;
# OPT's position embedding) or one of the norms adapted by name (Phi-3, T5)
RELEASING = ["zero3", "fsdp"]
MORE_MODELS = ["gemma", "opt", "phi3", "t5"]


# ---------------------------------------------------------------- layers

def foreign_layer(name):
    """An instance of the class FOREIGN names, with random parameters."""
    module, _, cls = name.rpartition(".")
    cls = getattr(importlib.import_module(module), cls)
    kind = FOREIGN[name][0]
    if kind is Conv1D:
        layer = cls(5, 7)
    elif kind is nn.Embedding:  # OPT's takes no padding_idx (its offset stands for one); Gemma's scale is sqrt(width)
        layer = cls(11, 7) if cls.__name__.startswith("OPT") else cls(11, 7, padding_idx=0, embed_scale=7 ** 0.5)
    else:
        layer = cls(7, eps=1e-5)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


def layer_input(name, dtype):
    """What the layer FOREIGN names takes: a float input, token ids (Gemma's
    embedding, the padding id among them), or an attention mask padded on
    the left (OPT's position embedding)."""
    if FOREIGN[name][0] is not nn.Embedding:
        x = torch.randn(2, 3, 7) * 3 + 1
        return x.bfloat16() if dtype in ("bf16", "fp32 weights, bf16 input") else x
    if name.rpartition(".")[2].startswith("OPT"):
        return torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    return torch.tensor([[1, 0, 5, 10], [3, 3, 0, 7]])


def run(layer, x):
    x = x.clone().requires_grad_(x.is_floating_point())
    out = layer(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype))
    return out, x.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp32 weights, bf16 input", "bf16 weights, fp32 input"])
@pytest.mark.parametrize("name", list(FOREIGN))
def test_adapted_layer_equals_the_original(name, dtype):
    """The converted layer computes what transformers' does. In bf16 the
    output must be equal bit for bit (where the cast happens shows there),
    and with mixed dtypes its dtype too (Llama's promotes, Gemma's does not;
    T5's casts to a bf16 weight's dtype, not to the input's). An embedding
    that keeps its own forward (Gemma's scale, OPT's offset) runs it around
    tiny_zero's lookup."""
    torch.manual_seed(0)
    theirs = foreign_layer(name)
    mixed = dtype not in ("fp32", "bf16")
    if mixed and isinstance(theirs, transformers.pytorch_utils.Conv1D):
        pytest.skip("addmm takes no mixed dtypes, in transformers' Conv1D as in ours")
    if mixed and isinstance(theirs, nn.Embedding):
        pytest.skip("an embedding's input is integers")
    if dtype.startswith("bf16"):
        theirs = theirs.bfloat16()
    ours = swap_layers(nn.Sequential(copy.deepcopy(theirs)))[0]
    assert isinstance(ours, CallbackLayer) and isinstance(ours, type(theirs))
    x = layer_input(name, dtype)
    (out_t, gx_t, g_t), (out_o, gx_o, g_o) = run(theirs, x), run(ours, x)
    exact = dict(rtol=0, atol=0) if dtype != "fp32" else dict(rtol=1e-6, atol=1e-6)
    assert out_o.dtype == out_t.dtype
    torch.testing.assert_close(out_o, out_t, **exact)
    torch.testing.assert_close(gx_o, gx_t, **(dict(rtol=1e-2, atol=1e-2) if dtype != "fp32" else exact))
    for key in g_t:
        torch.testing.assert_close(g_o[key], g_t[key], rtol=1e-2 if dtype != "fp32" else 1e-5, atol=1e-5, msg=key)


def tiny_model(name):
    """Two layers, hidden 32, vocab 64, no dropout: enough for every layer type."""
    small = dict(hf_checks.SMALL)
    configs = {
        "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**small, head_dim=8)),
        "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**small)),
        "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **small, num_local_experts=4, num_experts_per_tok=2)),
        "vit": lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48, image_size=8,
            patch_size=4, num_labels=3)),
    }
    torch.manual_seed(0)
    return configs[name]() if name in configs else hf_checks.build(name)


CONVERTED = MODELS + ["qwen3", "mistral", "gemma", "bert", "opt", "phi3", "t5"]


@pytest.mark.parametrize("name", CONVERTED)
def test_whole_model_converts_and_equals_the_original(name):
    theirs = tiny_model(name)
    ours = swap_layers(copy.deepcopy(theirs))  # raises if a parameter lives in a layer it does not convert
    assert list(ours.state_dict()) == list(theirs.state_dict())
    originals = dict(theirs.named_modules())
    for path, layer in ours.named_modules():  # Gemma's embedding too, though the converted head holds its weight
        if qualified_name(type(originals[path])) in FOREIGN:
            assert isinstance(layer, CallbackLayer), path
    x, y = hf_checks.global_batch(0, 1)
    losses = [hf_checks.loss_of(model, x, y) for model in (theirs, ours)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (key, p), q in zip(theirs.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name, kept", [
    ("mixtral", {"model.layers.0.mlp.experts": "MixtralExperts", "model.layers.0.mlp.gate": "MixtralTopKRouter"}),
    ("vit", {"vit.embeddings": "ViTEmbeddings"})])
def test_models_with_layers_tiny_zero_lacks_keep_them(name, kept):
    """Mixtral's experts (one 3-D tensor of every expert's weights) and its
    router, ViT's embeddings (a bare CLS token, a Conv2d inside): kept as they
    are, for a strategy's hooks (tests/hf_more_checks.py trains them); the
    layers around them convert (Mixtral's RMSNorm, adapted by name)."""
    theirs = tiny_model(name)
    ours = swap_layers(copy.deepcopy(theirs))
    modules = dict(ours.named_modules())
    for path, cls in kept.items():
        assert type(modules[path]).__name__ == cls and not isinstance(modules[path], CallbackLayer), path
    assert isinstance(modules["vit.layers.0.mlp.fc1" if name == "vit" else "model.norm"], CallbackLayer)


# ---------------------------------------------------------------- worlds

SAVED_SEED = 2  # not the seed of any model the workers build


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """What save_pretrained writes, for each model (GPT-2's in 20 KB shards,
    with an index), and llama's state_dict as a torch file."""
    root = tmp_path_factory.mktemp("hf")
    for name in MODELS:
        model = hf_checks.build(name, seed=SAVED_SEED)
        model.save_pretrained(root / name, max_shard_size="20KB" if name == "gpt2" else "1GB")
        if name == "llama":
            torch.save(model.state_dict(), root / "llama.pt")
    hf_checks.build("llama", seed=SAVED_SEED, intermediate_size=56).save_pretrained(root / "llama-wider")
    return root


def sources(root):
    """(model, what load_pretrained reads, the directory from_pretrained reads)."""
    return [(name, root / name, root / name) for name in MODELS] + [("llama", root / "llama.pt", root / "llama")]


def test_load_pretrained_into_a_plain_module(saved):
    """Single device: built under meta_parameters() (parameters on meta, the
    rotary buffers real), then loaded; the tied head stays tied."""
    with meta_parameters():
        module = hf_checks.build("qwen2")
    assert all(p.is_meta for p in module.parameters()) and not any(b.is_meta for b in module.buffers())
    load_pretrained(module, saved / "qwen2")
    assert module.lm_head.weight is module.model.embed_tokens.weight and not module.lm_head.weight.is_meta
    x = hf_checks.global_batch(7, 1)[0]
    torch.testing.assert_close(module(input_ids=x).logits, hf_checks.reference_logits("qwen2", saved / "qwen2"),
                               rtol=0, atol=0)


@pytest.fixture(scope="module")
def world2(saved):
    plan = [("parity", "parity", (MODELS, STRATEGIES)),
            ("parity more", "parity", (MORE_MODELS, RELEASING)),
            ("fine_tuning", "fine_tuning", (["llama", "gpt2"], STRATEGIES)),
            ("lora", "lora_fine_tuning", (STRATEGIES + ["offload"],)),
            ("load", "load_all", (sources(saved), STRATEGIES, False))]
    plan += [(f"errors {s}", "load_errors", (s, saved / "llama", saved / "qwen2", saved / "llama-wider"))
             for s in STRATEGIES]
    plan += [(f"meta {s}", "built_on_meta", (s, sources(saved), saved / "llama")) for s in STRATEGIES]
    plan += [(f"trained {name}", "train_and_save", (name, strategy, saved / f"checkpoint-{name}"))
             for name, strategy in [("qwen2", "zero3"), ("gpt2", "fsdp")]]
    plan += [(f"read {s}", "elements_read", (s, saved / "llama")) for s in ("ddp", "zero3", "fsdp")]
    return run_checks(2, "hf_checks", plan)


def parity_failures(results):
    return [f for rank in results for failures, _, _ in rank.values() for f in failures]


def test_every_strategy_trains_hf_models_as_torch_does_world_2(world2):
    failures = parity_failures(world2["parity"])
    assert not failures, "\n".join(failures[:40])


def test_zero3_and_fsdp_train_gemma_opt_phi3_and_t5_as_torch_does_world_2(world2):
    """Gemma's embedding runs its own forward (the scale) around the
    strategy's layer, which gathers the weight it shares with the head."""
    failures = parity_failures(world2["parity more"])
    assert not failures, "\n".join(failures[:40])


def test_fine_tuning_with_padding_masked_labels_and_checkpointing_as_torch(world2):
    failures = [f for rank in world2["fine_tuning"] for f in rank]
    assert not failures, "\n".join(failures[:20])


def test_peft_lora_trains_and_merges_as_torch(world2):
    failures = [f for rank in world2["lora"] for f in rank]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.slow
def test_every_strategy_trains_hf_models_as_torch_does_world_3():
    results = run_checks(3, "hf_checks", [("parity", "parity", (MODELS, STRATEGIES))])
    failures = parity_failures(results["parity"])
    assert not failures, "\n".join(failures[:40])


def test_load_pretrained_into_every_strategy(world2):
    failures = [f for rank in world2["load"] for f in rank]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp"])
def test_each_rank_reads_only_what_it_holds(world2, strategy):
    """The elements taken out of the safetensors file: ddp holds and reads
    everything; a zero3 rank the tensors it owns; an fsdp rank its slice of
    each layer, read as the rows it spans (at most 2 more rows of 48 per
    piece: llama's widest row)."""
    for read, held, pieces, total in world2[f"read {strategy}"]:
        if strategy == "ddp":
            assert read == held == total
        else:
            assert held <= read <= held + 2 * 48 * pieces and read < 0.7 * total, (read, held, pieces, total)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_pretrained_into_a_model_built_on_meta(world2, strategy):
    """Built under meta_parameters(): the saved weights, the original's
    outputs; forward before loading raises; built entirely on meta, the
    rotary frequencies, which no file holds, are named."""
    ranks = world2[f"meta {strategy}"]
    failures = [f for rank_failures, _ in ranks for f in rank_failures]
    assert not failures, "\n".join(failures[:20])
    errors = ranks[0][1]
    assert all(rank[1] == errors for rank in ranks), ranks
    assert "load them first, with tiny_zero.checkpoint.load_pretrained" in errors["forward before loading"]
    assert "model.rotary_emb.inv_freq" in errors["meta buffers"]
    assert "meta_parameters()" in errors["meta buffers"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_errors_are_clear_alike_on_every_rank_and_change_nothing(world2, strategy):
    ranks = world2[f"errors {strategy}"]
    errors, unchanged = ranks[0]
    assert all(rank == (errors, True) for rank in ranks), ranks
    assert unchanged
    other = errors["other model"]
    assert other.startswith(f"cannot load pretrained weights from ") and "qwen2" in other
    assert "1 of this model's tensors are not in it: lm_head.weight" in other  # qwen2's head is tied
    assert "6 of its tensors are not in this model: model.layers.0.self_attn.k_proj.bias" in other
    assert ("shapes differ: model.layers.0.mlp.gate_proj.weight (56, 32) in the file, (48, 32) in this model"
            in errors["other shapes"])
    assert errors["no such path"].endswith("nowhere: it does not exist")


@pytest.mark.parametrize("name", ["qwen2", "gpt2"])
def test_consolidated_safetensors_load_with_from_pretrained(world2, saved, tmp_path, name):
    """python -m tiny_zero.checkpoint consolidate ... --format safetensors,
    next to the model's config.json: from_pretrained gives the trained values
    (qwen2: the tied head written once; gpt2: Conv1D's [in, out] layout)."""
    out = tmp_path / name
    out.mkdir()
    shutil.copy(saved / name / "config.json", out)
    consolidate_main(["consolidate", str(saved / f"checkpoint-{name}"), str(out / "model.safetensors"),
                      "--format", "safetensors"])
    loaded = hf_checks.configs()[name][0].from_pretrained(out).state_dict()
    trained, initial = world2[f"trained {name}"][0], hf_checks.build(name).state_dict()
    assert loaded.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key
    assert any(not torch.equal(value, initial[key]) for key, value in trained.items())  # it did train


@pytest.mark.parametrize("tied", [True, False])
def test_example_llama_is_hugging_face_llama(tied):
    """example/model.py's Llama has LlamaForCausalLM's names and math: its
    state_dict loads into transformers' model (strictly) and the logits agree."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from example.model import build_model
    ours = build_model("llama-tiny", seed=1, tie_embeddings=tied)
    c = ours.config
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
        max_position_embeddings=c.block_size, rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps,
        tie_word_embeddings=tied))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randint(0, c.vocab_size, (2, c.block_size), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(x), theirs(input_ids=x).logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory):
    """A saved Llama with a vocabulary of 256: the examples feed bytes."""
    directory = tmp_path_factory.mktemp("byte-llama")
    hf_checks.build("llama", vocab_size=256).save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_examples_train_a_saved_hf_model(byte_llama):
    """--model hf:DIR: every strategy on 2 ranks prints the losses of one device."""
    from test_examples import one_device_and_two_ranks
    flags = ["--model", f"hf:{byte_llama}", "--seq-len", "32", "--eval-batches", "1", "--steps", "3"]
    single, ranks = one_device_and_two_ranks(flags, STRATEGIES)
    assert list(ranks) == STRATEGIES and len(single) == 3
    for strategy, curve in ranks.items():
        assert curve == pytest.approx(single, rel=1e-5, abs=0), strategy
