"""Checks run inside spawned worlds for tests/test_context.py: ring attention
and Ulysses against F.scaled_dot_product_attention on the whole sequence."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tiny_zero.context.ring import ring_attention, zigzag_positions
from tiny_zero.context.ulysses import contiguous_positions, ulysses_attention

METHODS = {"ring": (ring_attention, zigzag_positions), "ulysses": (ulysses_attention, contiguous_positions)}
RTOL, ATOL = 1e-5, 1e-6


def differences(name, got, want):
    if torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        return []
    return [f"{name}: max difference {(got - want).abs().max().item():.3g}"]


def attention_parity(method, cases):
    """[failures] of method's attention on this rank's share against torch's on
    the whole sequence: outputs and the grads of q, k, v. cases: (is_causal,
    heads, kv_heads)."""
    attention, positions_of = METHODS[method]
    rank, size = dist.get_rank(), dist.get_world_size()
    failures = []
    for is_causal, heads, kv_heads in cases:
        g = torch.Generator().manual_seed(heads * 10 + kv_heads)
        length, dim = 4 * size, 8
        q, dout = (torch.randn(2, heads, length, dim, generator=g) for _ in range(2))
        k, v = (torch.randn(2, kv_heads, length, dim, generator=g) for _ in range(2))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*full, is_causal=is_causal, enable_gqa=heads != kv_heads)
        out.backward(dout)
        mine = positions_of(rank, size, length)
        local = [t[..., mine, :].clone().requires_grad_() for t in (q, k, v)]
        local_out = attention(*local, is_causal=is_causal)
        local_out.backward(dout[..., mine, :])
        case = f"{method} causal={is_causal} heads={heads}/{kv_heads}"
        failures += differences(f"{case} output", local_out, out[..., mine, :].detach())
        for name, a, b in zip("qkv", local, full):
            failures += differences(f"{case} d{name}", a.grad, b.grad[..., mine, :])
    return failures


def ulysses_refuses(heads, kv_heads):
    """The error Ulysses gives when the heads do not divide by the group, or None."""
    size = dist.get_world_size()
    q = torch.randn(1, heads, 2, 4)
    k = torch.randn(1, kv_heads, 2, 4)
    try:
        ulysses_attention(q, k, k, is_causal=True)
    except ValueError as e:
        return str(e)
    return f"no error with {heads}/{kv_heads} heads on {size} ranks"


class Encoder(torch.nn.Module):
    """A tiny model whose every token attends to every other (is_causal=False)."""

    def __init__(self, heads):
        super().__init__()
        torch.manual_seed(0)
        width, self.heads = 8 * heads, heads
        self.wte, self.wpe = torch.nn.Embedding(256, width), torch.nn.Embedding(64, width)
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 256)

    def forward(self, idx, targets=None, position_ids=None):
        positions = torch.arange(idx.shape[1]) if position_ids is None else position_ids
        x = self.wte(idx) + self.wpe(positions)
        rows, length, width = x.shape
        q, k, v = (t.view(rows, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v)
        logits = self.head(x + self.out(y.transpose(1, 2).reshape(rows, length, width)))
        return logits if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(kind, heads):
    """A tiny model: the example GPT or a Hugging Face Llama with GQA (causal), or Encoder (not)."""
    if kind == "encoder":
        return Encoder(heads)
    if kind == "gpt":
        from example.model import build_model
        return build_model("tiny", n_head=heads, n_embd=8 * heads)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=8 * heads, intermediate_size=16 * heads, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def run(model, kind, x):
    """The loss, called as each model takes its targets: the GPT's targets, Hugging Face's labels."""
    if kind != "llama":
        return model(x[:, :-1], x[:, 1:])
    return model(input_ids=x, labels=x).loss


def model_parity(kind, method, cp_size, steps=3, heads=4, length=16, strategy=None):
    """[failures] of ContextParallel (or context over `strategy`'s wrapper,
    such as "zero2") against single-process torch: the outputs, the loss of
    every step and every parameter after `steps` AdamW steps."""
    import copy
    import tiny_zero
    from tiny_zero.context import ContextParallel, ContextParallelAdamW, data_parallel
    module = build(kind, heads)
    reference = copy.deepcopy(module)
    wrapper, adamw = (ContextParallel, ContextParallelAdamW) if strategy is None else tiny_zero.STRATEGIES[strategy]
    model = (wrapper if strategy is None else data_parallel(wrapper))(module, method=method, cp_size=cp_size)
    # eps=1, as DESIGN.md says for attention models: the k bias's grad is rounding alone, which eps=1e-8 would blow up
    options = dict(lr=1e-2, betas=(0.9, 0.95), eps=1.0, weight_decay=0.1)
    opt, ref_opt = adamw(model, **options), torch.optim.AdamW(reference.parameters(), **options)
    rows = 2
    failures = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 256, (rows * model.dp_size, length + (kind != "llama")), generator=g)
        mine = x[model.dp_rank * rows:(model.dp_rank + 1) * rows]
        if step == 0:
            tokens = mine[:, :length]
            logits = model(tokens) if kind != "llama" else model(input_ids=tokens).logits
            want = reference(tokens) if kind != "llama" else reference(input_ids=tokens).logits
            failures += differences("logits", model.gather_sequence(logits), want.detach())
        loss = run(model, kind, mine)
        with torch.no_grad():
            failures += differences(f"step {step} loss", loss.detach(), run(reference, kind, mine))
        loss.backward()
        opt.step()
        opt.zero_grad()
        run(reference, kind, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = model.full_state_dict()
    for name, value in reference.state_dict().items():
        failures += differences(f"{name} after {steps} steps", full[name], value)
    return failures


def refused(kind, method, cp_size, heads, length):
    """The error ContextParallel gives for a sequence that does not split, or
    heads that Ulysses cannot split; or a line saying there was none."""
    from tiny_zero.context import ContextParallel
    model = ContextParallel(build(kind, heads), method=method, cp_size=cp_size)
    x = torch.randint(0, 256, (2, length + 1), generator=torch.Generator().manual_seed(0))
    try:
        run(model, kind, x)
    except ValueError as e:
        return str(e)
    return f"no error: {kind} {method} heads={heads} length={length}"


def save_and_load(root):
    """[failures]: a ContextParallel checkpoint, loaded into a fresh one, gives
    the same parameters; and activation checkpointing is refused."""
    import tiny_zero
    from tiny_zero.context import ContextParallel, ContextParallelAdamW
    model = ContextParallel(build("gpt", 4))
    opt = ContextParallelAdamW(model, lr=1e-2, eps=1.0)
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    run(model, "gpt", x).backward()
    opt.step()
    tiny_zero.checkpoint.save(root, model, opt, step=1)
    fresh = ContextParallel(build("gpt", 4))
    fresh_opt = ContextParallelAdamW(fresh, lr=1e-2, eps=1.0)
    info = tiny_zero.checkpoint.load(root, fresh, fresh_opt)
    saved, loaded = model.full_state_dict(), fresh.full_state_dict()
    failures = [] if info["step"] == 1 else [f"step {info['step']}"]
    failures += [f"{name} not loaded" for name in saved if not torch.equal(saved[name], loaded[name])]
    module = build("gpt", 4)
    module.config.checkpoint_activations = True
    try:
        ContextParallel(module)
        failures.append("activation checkpointing not refused")
    except ValueError as e:
        failures += [] if "activation checkpointing" in str(e) else [str(e)]
    return failures
