"""Worker functions for tests/test_hf_more.py: Hugging Face models with
modules tiny_zero has no layer for (convolutions, norms on no list, bare
parameters, mixture-of-experts tensors and routers, subclasses of Linear or
Embedding with a forward of their own), from tiny configs (nothing is
downloaded), trained by every strategy through module hooks against
single-process torch: the loss at every step, every parameter after the
steps (tests/hf_checks.py's tolerances).

The reference computes each rank's rows apart and averages the losses, as
torch DDP averages the grads: a contrastive loss (CLIP) or BatchNorm
(ResNet) sees one rank's rows only, there too.

A check returns what went wrong as a list of strings (empty: all is well)."""
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as T

import tiny_zero

VOCAB, SEQ, PER_RANK, STEPS = 64, 8, 2, 3
LR, WD, EPS = 1e-2, 0.1, 1.0  # as tests/hf_checks.py
RTOL, ATOL = 1e-5, 1e-6
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, pad_token_id=0, bos_token_id=0,
               eos_token_id=0, decoder_start_token_id=0)
MOE = dict(num_experts_per_tok=2)
DEBERTA_INIT, DEBERTA_SCALE = 0.2, 100  # weights x10, relative embeddings x1000: read as zeros, the loss moves by 4e-2


def configs(scale=1, layers=2):
    """name: (what builds the model, the kind of its inputs); `scale` widens
    ViT and Mixtral and `layers` deepens them (the memory check: parameters,
    not activations, dominate, and more blocks than are gathered at once)."""
    wide = dict(hidden_size=32 * scale, intermediate_size=48 * scale, num_hidden_layers=layers)
    return {
        "falcon": (lambda: T.FalconForCausalLM(T.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, bos_token_id=0,
            eos_token_id=0)), "tokens"),
        "olmo2": (lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**SMALL)), "tokens"),
        "cohere": (lambda: T.CohereForCausalLM(T.CohereConfig(**SMALL)), "tokens"),
        "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(**{**SMALL, **wide}, **MOE, num_local_experts=4)),
                    "tokens"),
        "qwen3_moe": (lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            **SMALL, **MOE, head_dim=8, num_experts=4, moe_intermediate_size=16)), "tokens"),
        "deepseek_v3": (lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            **{**SMALL, "num_key_value_heads": 4}, **MOE, n_routed_experts=4, moe_intermediate_size=16,
            first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8)), "tokens"),
        "gpt_oss": (lambda: T.GptOssForCausalLM(T.GptOssConfig(
            **SMALL, **MOE, head_dim=8, num_local_experts=4, sliding_window=4)), "tokens"),
        "bart": (lambda: T.BartForConditionalGeneration(T.BartConfig(
            **SEQ2SEQ, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)), "seq2seq"),
        "whisper": (lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
            **SEQ2SEQ, num_mel_bins=8, max_source_positions=8, max_target_positions=16)), "speech"),
        "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(
            **wide, num_attention_heads=4, image_size=8, patch_size=4, num_labels=3)), "image"),
        "convnext": (lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
            hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3, image_size=8,
            layer_scale_init_value=0.5)), "image"),
        "resnet": (lambda: T.ResNetForImageClassification(T.ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)), "image"),
        "clip": (lambda: T.CLIPModel(T.CLIPConfig(text_config=dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=0), vision_config=dict(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=8,
            patch_size=4), projection_dim=16)), "clip"),
        "deberta": (deberta, "tokens"),
    }


def deberta():
    """DeBERTa-v2 with its relative embedding frozen: read outside that
    Embedding's forward (the encoder's get_rel_embedding), where no grad
    comes to tell."""
    model = T.DebertaV2ForMaskedLM(T.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=DEBERTA_INIT))
    rel = model.deberta.encoder.rel_embeddings.weight
    with torch.no_grad():
        rel.mul_(DEBERTA_SCALE)
    rel.requires_grad_(False)
    return model


def build(name, checkpointing=False, scale=1, layers=2):
    torch.manual_seed(0)
    model = configs(scale, layers)[name][0]()
    if checkpointing:  # transformers' default: non-reentrant, which recomputes in backward what forward saved
        model.gradient_checkpointing_enable()
    return model


def inputs(kind, step, world_size):
    """The global batch: (model inputs, labels or None)."""
    g = torch.Generator().manual_seed(step)
    rows = world_size * PER_RANK
    tokens = torch.randint(2, VOCAB, (rows, SEQ + 1), generator=g)
    if kind == "tokens":
        return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]
    if kind == "seq2seq":
        return {"input_ids": tokens[:, :-1], "decoder_input_ids": tokens[:, :-1]}, tokens[:, 1:]
    if kind == "speech":
        return {"input_features": torch.randn(rows, 8, 16, generator=g), "decoder_input_ids": tokens[:, :-1]}, \
            tokens[:, 1:]
    pixels = torch.randn(rows, 3, 8, 8, generator=g)
    if kind == "image":
        return {"pixel_values": pixels}, tokens[:, 0] % 3
    return {"input_ids": tokens[:, :-1], "pixel_values": pixels, "return_loss": True}, None  # clip


def loss_of(model, batch, labels):
    out = model(**batch)
    if labels is None:
        return out.loss
    return F.cross_entropy(out.logits.flatten(0, -2), labels.flatten())


def rows(batch, labels, rank):
    part = lambda t: t[rank * PER_RANK:(rank + 1) * PER_RANK] if isinstance(t, torch.Tensor) else t  # noqa: E731
    return {k: part(v) for k, v in batch.items()}, None if labels is None else part(labels)


def reference(name, world_size):
    """Per step: the loss (each rank's rows apart, averaged), then the parameters."""
    model, kind = build(name), configs()[name][1]  # never checkpointed: the same numbers
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS, weight_decay=WD)
    losses = []
    for step in range(STEPS):
        batch, labels = inputs(kind, step, world_size)
        loss = sum(loss_of(model, *rows(batch, labels, r)) for r in range(world_size)) / world_size
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}


def train_and_compare(name, strategy, want_losses, want, checkpointing):
    wrapper, optimizer = tiny_zero.STRATEGIES[strategy]
    model, kind = wrapper(build(name, checkpointing)), configs()[name][1]
    opt = optimizer(model, lr=LR, eps=EPS, weight_decay=WD)
    world, rank = dist.get_world_size(), dist.get_rank()
    failures = []
    for step, ok in enumerate(want_losses):
        loss = loss_of(model, *rows(*inputs(kind, step, world), rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        got = mean.item() / world
        if abs(got - ok) > RTOL * abs(ok):
            failures.append(f"{name}/{strategy} world {world} step {step}: loss {got} vs torch {ok}")
    state = model.full_state_dict()
    return failures + [f"{name}/{strategy}: {key} differs by {(state[key] - v).abs().max().item():.2e}"
                       for key, v in want.items() if not torch.allclose(state[key], v, rtol=RTOL, atol=ATOL)]


def zeros_move_deberta():
    """Failures: reading DeBERTa's relative embeddings as zeros must move the first loss by more than 1e-2."""
    model = build("deberta")
    batch = inputs("tokens", 0, 1)
    before = loss_of(model, *batch).item()
    with torch.no_grad():
        model.deberta.encoder.rel_embeddings.weight.zero_()
    moved = abs(loss_of(model, *batch).item() - before)
    return [] if moved > 1e-2 else [f"deberta: zeros move the loss by {moved:.1e} only"]


def parity(names, strategies, checkpointing=False):
    """Failures; with `checkpointing`, transformers' gradient checkpointing on."""
    failures = zeros_move_deberta() if "deberta" in names else []
    for name in names:
        want_losses, want = reference(name, dist.get_world_size())
        for strategy in strategies:
            try:
                failures += train_and_compare(name, strategy, want_losses, want, checkpointing)
            except Exception:  # as a failure: the other models and strategies still run
                failures.append(f"{name}/{strategy}: {traceback.format_exc(limit=-3)}")
    return failures


def blocks_of(model):
    """The repeated blocks, found as tiny_zero's units finds them: the children of a ModuleList of one class."""
    return next(list(m) for m in model.modules()
                if isinstance(m, torch.nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1)


def peak_of(name, strategy):
    """Peak live tensor bytes on this rank over the second of two steps,
    everything counted (built inside the count): tiny_zero's strategy, or
    FSDP2 (fully_shard per block, then the root, as the issue's runs did)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tiny_zero.measure.memory import TensorMemory
    kind = configs()[name][1]
    with TensorMemory() as memory:
        if strategy == "torch_fsdp2":
            model = build(name, scale=4, layers=8)
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in blocks_of(model):
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WD, foreach=False)
        else:
            wrapper, optimizer = tiny_zero.STRATEGIES[strategy]
            model = wrapper(build(name, scale=4, layers=8))
            opt = optimizer(model, lr=LR, eps=EPS, weight_decay=WD)
            gathered = watch_gathered(model)
        for step in range(2):
            if step == 1:
                memory.reset_peak()
            loss_of(model, *rows(*inputs(kind, step, dist.get_world_size()), dist.get_rank())).backward()
            opt.step()
            opt.zero_grad()
        if strategy == "torch_fsdp2":
            return {"peak": memory.peak}
        return {"peak": memory.peak, "gathered": gathered[0], "two units": 2 * max(f.numel() * f.element_size()
                                                                                 for f in model.unit_buffer.values())}


def watch_gathered(model):
    """[the most bytes of gathered units (their buffers' storage) after any gather], kept up to date."""
    most = [0]
    wait_for = model.wait_for

    def wait_and_count(*args, **kwargs):
        wait_for(*args, **kwargs)
        most[0] = max(most[0], sum(f.untyped_storage().nbytes() for f in model.unit_buffer.values()))

    model.wait_for = wait_and_count
    return most


def memory_against_fsdp2(names):
    """{(model, strategy or "torch_fsdp2"): this rank's peak bytes}."""
    return {(name, strategy): peak_of(name, strategy) for name in names for strategy in ("torch_fsdp2", "zero3", "fsdp")}
