"""Worker functions for tests/test_hf.py: Hugging Face models (tiny configs,
nothing downloaded) trained and loaded by every strategy (run on every rank).

A check returns what went wrong as a list of strings (empty: all is well),
so that one failing strategy does not end the world the others run in.
"""
import copy
import functools
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import transformers

import tiny_zero
from tiny_zero.checkpoint import CheckpointError, load_pretrained
from tiny_zero.materialize import meta_parameters

VOCAB, SEQ, PER_RANK = 64, 8, 2
LR, WD, EPS, STEPS = 1e-2, 0.1, 1.0, 4  # eps=1: the update is about lr * g (see tests/parity_checks.py)
RTOL, ATOL = 1e-5, 1e-6
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def configs():
    """name: (model class, config). Llama: untied head, grouped-query attention;
    Qwen2: tied head, qkv biases; GPT-2: transformers' Conv1D, tied head.
    Gemma: a scaled embedding (its own forward) tied to the head; OPT: a
    learned position embedding with an offset; Phi-3: Phi3RMSNorm, fused qkv;
    T5: an encoder-decoder, T5LayerNorm, relative attention buckets."""
    return {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL)),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)),
        "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
        "gemma": (transformers.GemmaForCausalLM, transformers.GemmaConfig(**SMALL, head_dim=8)),
        "opt": (transformers.OPTForCausalLM, transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, bos_token_id=0,
            eos_token_id=0, pad_token_id=0)),
        "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config(**SMALL)),
        "t5": (transformers.T5ForConditionalGeneration, transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, dropout_rate=0.0,
            relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=0)),
    }


def build(name, seed=0, **config_changes):
    cls, config = configs()[name]
    for key, value in config_changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = cls(config)
    if name == "gemma":  # its norms start with w = 0, where Gemma's 1 + w and w would differ least
        with torch.no_grad():
            for m in model.modules():
                if type(m).__name__ == "GemmaRMSNorm":
                    m.weight.normal_()
    return model


def loss_of(model, x, y):
    """An encoder-decoder (T5) reads x on both sides."""
    decoder = dict(decoder_input_ids=x) if getattr(model, "module", model).config.is_encoder_decoder else {}
    return F.cross_entropy(model(input_ids=x, **decoder).logits.flatten(0, 1), y.flatten())


def global_batch(step, world_size):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (world_size * PER_RANK, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def my_rows(batch):
    rank = dist.get_rank()
    return [t[rank * PER_RANK:(rank + 1) * PER_RANK] for t in batch]


def reference(name, world_size):
    """Single-process torch: transformers' own layers, torch.optim.AdamW, the
    global batch. Per step: the loss and the state_dict after the step."""
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    history = []
    for step in range(STEPS):
        loss = loss_of(model, *global_batch(step, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append((loss.item(), {k: v.detach().clone() for k, v in model.state_dict().items()}))
    return history


def train_and_compare(name, strategy, ref):
    """Failures, and the largest relative loss and absolute parameter differences."""
    wrapper, optimizer = tiny_zero.STRATEGIES[strategy]
    model = wrapper(build(name))
    opt = optimizer(model, lr=LR, eps=EPS, weight_decay=WD)
    failures, loss_diff, param_diff = [], 0.0, 0.0
    for step, (ref_loss, ref_state) in enumerate(ref):
        loss = loss_of(model, *my_rows(global_batch(step, dist.get_world_size())))
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = mean.item() / dist.get_world_size()
        where = f"{name}/{strategy} world {dist.get_world_size()} step {step}"
        loss_diff = max(loss_diff, abs(mean - ref_loss) / abs(ref_loss))
        if abs(mean - ref_loss) > RTOL * abs(ref_loss):
            failures.append(f"{where}: loss {mean} vs torch {ref_loss}")
        state = model.full_state_dict()
        for key, value in ref_state.items():
            param_diff = max(param_diff, (state[key] - value).abs().max().item())
            if not torch.allclose(state[key], value, rtol=RTOL, atol=ATOL):
                failures.append(f"{where}: {key} differs by {(state[key] - value).abs().max().item():.2e}")
    return failures, loss_diff, param_diff


def parity(names, strategies):
    """{(model, strategy): (failures, loss difference, parameter difference)}."""
    results = {}
    for name in names:
        ref = reference(name, dist.get_world_size())
        for strategy in strategies:
            try:
                results[name, strategy] = train_and_compare(name, strategy, ref)
            except Exception:  # as a failure: the other models and strategies still run
                results[name, strategy] = ([f"{name}/{strategy}: {traceback.format_exc(limit=-3)}"], None, None)
    return results


def padded_batch(step, world_size):
    """(input_ids, attention_mask, labels): rows of random lengths, padded on
    the right with pad_token_id, labels -100 over the padding, as a
    fine-tuning collator makes them."""
    x, _ = global_batch(step, world_size)
    lengths = torch.randint(2, SEQ + 1, (x.shape[0],), generator=torch.Generator().manual_seed(100 + step))
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    return x.masked_fill(mask == 0, 0), mask, x.masked_fill(mask == 0, -100)


def fine_tuning(names, strategies):
    """Fine-tuning as transformers users write it: padded rows with an
    attention mask, labels -100 over the padding and the model's own loss
    (labels=), gradient checkpointing on (transformers' default, non-reentrant).
    Each rank's loss is the mean over its own tokens, so the reference
    averages the ranks' losses, as torch DDP averages their grads. After the
    second step, a greedy model.module.generate() in eval mode (a sample, as
    users take one mid-run) gives torch's tokens, and training goes on as
    torch's. Failures."""
    world, rank = dist.get_world_size(), dist.get_rank()
    failures = []
    for name in names:
        ref, module = build(name), build(name)
        for m in (ref, module):
            m.gradient_checkpointing_enable()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=WD)
        for step in range(3):
            rows = [t.view(world, PER_RANK, SEQ) for t in padded_batch(step, world)]
            losses = [ref(input_ids=x, attention_mask=m, labels=y).loss for x, m, y in zip(*rows)]
            (sum(losses) / world).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            if step == 1:
                torch_tokens = sample(ref)
        for strategy in strategies:
            wrapper, optimizer = tiny_zero.STRATEGIES[strategy]
            model = wrapper(copy.deepcopy(module))
            opt = optimizer(model, lr=LR, eps=EPS, weight_decay=WD)
            for step in range(3):
                x, m, y = (t[rank * PER_RANK:(rank + 1) * PER_RANK] for t in padded_batch(step, world))
                model(input_ids=x, attention_mask=m, labels=y).loss.backward()
                opt.step()
                opt.zero_grad()
                if step == 1 and not torch.equal(tokens := sample(model.module), torch_tokens):
                    failures.append(f"{name}/{strategy} generate(): {tokens.tolist()}, torch {torch_tokens.tolist()}")
            state = model.full_state_dict()
            failures += [f"{name}/{strategy} fine-tuning: {key} differs by {(state[key] - want).abs().max():.2e}"
                         for key, want in ref.state_dict().items()
                         if not torch.allclose(state[key], want, rtol=RTOL, atol=ATOL)]
    return failures


def lora(base):
    """peft's LoRA on a tiny Llama: q_proj and v_proj, B not zero at the start
    (so that the base weights' grads and the merge both show)."""
    import peft
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(base, config)


def lora_fine_tuning(strategies):
    """peft LoRA, the base frozen, clipped: 3 steps train every parameter as
    torch's. Then the merge, as docs/huggingface.md gives it: every rank
    gathers model.full_state_dict() into an unwrapped copy, which
    merge_and_unload() merges as torch's. Failures."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = lora(build("llama"))
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, eps=EPS, weight_decay=WD)
    for step in range(3):
        loss_of(ref, *global_batch(step, world)).backward()
        nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
    merged = copy.deepcopy(ref).merge_and_unload().state_dict()
    failures = []
    for strategy in strategies:
        wrapper, optimizer = tiny_zero.STRATEGIES[strategy]
        model = wrapper(lora(build("llama")))
        opt = optimizer(model, lr=LR, eps=EPS, weight_decay=WD)
        for step in range(3):
            loss_of(model, *my_rows(global_batch(step, world))).backward()
            model.clip_grad_norm_(0.05)
            opt.step()
            opt.zero_grad()
        state = model.full_state_dict()
        plain = lora(build("llama"))
        plain.load_state_dict(state)
        for what, got, want in (("LoRA", state, ref.state_dict()),
                                ("merged", plain.merge_and_unload().state_dict(), merged)):
            failures += [f"{strategy} {what}: {key} differs by {(got[key] - value).abs().max():.2e} on rank {rank}"
                         for key, value in want.items() if not torch.allclose(got[key], value, rtol=RTOL, atol=ATOL)]
    return failures


def sample(model):
    """Greedy tokens after two prompts, in eval mode (then back to training)."""
    model.eval()
    prompts = torch.tensor([[1, 5, 7, 9], [2, 3, 4, 6]])
    tokens = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6, do_sample=False,
                            pad_token_id=0)
    model.train()
    return tokens


def failures_of(fn, *args):
    """fn(*args)'s failures, or the exception it raised, as a failure."""
    try:
        return fn(*args)
    except Exception:
        return [traceback.format_exc(limit=-3)]


def wrap_for_loading(name, strategy, on_meta):
    """A model of `name` wrapped by `strategy`, its parameters not yet the
    saved ones: built on meta (only the parameters), or with another seed."""
    if on_meta:
        with meta_parameters():
            module = build(name)
    else:
        module = build(name, seed=1)
    return tiny_zero.STRATEGIES[strategy][0](module)


def load_and_compare(name, strategy, path, reference_dir, on_meta):
    """load_pretrained(path) into a fresh wrapped model: its logits equal
    those of transformers' from_pretrained(reference_dir), the same weights."""
    model = wrap_for_loading(name, strategy, on_meta)
    load_pretrained(model, path)
    with torch.no_grad():
        ours = model(input_ids=global_batch(7, 1)[0]).logits
    theirs = reference_logits(name, reference_dir)
    if not torch.allclose(ours, theirs, rtol=RTOL, atol=ATOL):
        return [f"{name}/{strategy} from {path.name}: logits differ by {(ours - theirs).abs().max().item():.2e}"]
    return []


@functools.cache
@torch.no_grad()
def reference_logits(name, directory):
    return configs()[name][0].from_pretrained(directory)(input_ids=global_batch(7, 1)[0]).logits


def load_all(sources, strategies, on_meta):
    """sources: [(model name, path, reference directory)]. Failures of every
    (source, strategy)."""
    return [f for name, path, reference_dir in sources for strategy in strategies
            for f in failures_of(load_and_compare, name, strategy, path, reference_dir, on_meta)]


def error_of(fn, *args):
    try:
        fn(*args)
    except (CheckpointError, RuntimeError) as e:
        return str(e)
    return None


def load_errors(strategy, saved, other_model, other_shapes):
    """The errors of loading files that do not fit, and whether the model is
    unchanged after them: `saved` holds llama's weights, `other_model`
    qwen2's, `other_shapes` a llama with a wider MLP."""
    model = wrap_for_loading("llama", strategy, on_meta=False)
    before = model.full_state_dict()
    errors = {what: error_of(load_pretrained, model, path) for what, path in
              [("other model", other_model), ("other shapes", other_shapes), ("no such path", saved / "nowhere")]}
    unchanged = all(torch.equal(before[k], v) for k, v in model.full_state_dict().items())
    return errors, unchanged


def built_on_meta(strategy, sources, saved):
    """Models built on meta: load_pretrained gives each the saved weights;
    before it, forward raises; buffers left on meta are named. Returns
    (failures, {what: the error raised})."""
    failures = load_all(sources, [strategy], on_meta=True)
    wrapper = tiny_zero.STRATEGIES[strategy][0]
    errors = {}
    try:
        with meta_parameters():
            module = build("llama")
        errors["forward before loading"] = error_of(wrapper(module), global_batch(0, 1)[0])
        with torch.device("meta"):  # buffers on meta too: the rotary frequencies are in no file
            module = build("llama")
        errors["meta buffers"] = error_of(load_pretrained, wrapper(module), saved)
    except Exception:
        failures.append(traceback.format_exc(limit=-3))
    return failures, errors


def train_and_save(name, strategy, directory):
    """One step, then tiny_zero.checkpoint.save; returns the full fp32 state."""
    wrapper, optimizer = tiny_zero.STRATEGIES[strategy]
    model = wrapper(build(name))
    opt = optimizer(model, lr=LR, eps=EPS, weight_decay=WD)
    model.backward(loss_of(model, *my_rows(global_batch(0, dist.get_world_size()))))
    opt.step()
    tiny_zero.checkpoint.save(directory, model, opt, step=1)
    return model.full_state_dict()


class Counting:
    """A safe_open handle, or one tensor's slice of it, that adds up the
    elements taken out of it."""

    def __init__(self, inner, taken):
        self.inner, self.taken = inner, taken

    def keys(self):
        return self.inner.keys()

    def get_shape(self):
        return self.inner.get_shape()

    def get_slice(self, key):
        return Counting(self.inner.get_slice(key), self.taken)

    def get_tensor(self, key):
        return self.count(self.inner.get_tensor(key))

    def __getitem__(self, index):
        return self.count(self.inner[index])

    def count(self, tensor):
        self.taken.append(tensor.numel())
        return tensor


def elements_read(strategy, path):
    """(elements this rank took out of the safetensors files, elements it
    holds, the pieces they are in, elements in the model), loading `path`
    into `strategy`."""
    from tiny_zero.checkpoint import pretrained
    taken, open_file = [], pretrained.Safetensors._open
    pretrained.Safetensors._open = staticmethod(lambda file, files: Counting(open_file(file, files), taken))
    try:
        model = wrap_for_loading("llama", strategy, on_meta=False)
        load_pretrained(model, path)
    finally:
        pretrained.Safetensors._open = staticmethod(open_file)
    pieces, total = model.pieces(), sum(p.numel() for p in build("llama").parameters())
    return sum(taken), sum(p.hi - p.lo for p in pieces), len(pieces), total
