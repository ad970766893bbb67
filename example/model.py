"""GPT-2 and Llama in plain torch.nn, read top to bottom.

Parameters live only in nn.Embedding, nn.LayerNorm, nn.RMSNorm and
nn.Linear, so a distributed wrapper can swap those modules for its own
subclasses. Every parameter's initial value depends only on (seed,
parameter name): a model built on the meta device can be materialised one
tensor at a time with ``model.init_parameter(name, tensor)`` and gets
exactly the values that a normally built model has.

The Llama (RMSNorm, SwiGLU MLP, rotary position embedding, grouped-query
attention) names its parameters and computes as Hugging Face's
LlamaForCausalLM does, so checkpoints load either way; its rotary embedding
has no long-context scaling (Llama 3.1's rope_scaling), so the 1B and 8B
configs give the shapes of those models (for tiny_zero.measure.estimate), not
their exact outputs at every position.
"""

import math
import zlib
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    bias: bool = True
    dropout: float = 0.0
    checkpoint_activations: bool = False


@dataclass
class LlamaConfig:
    vocab_size: int
    block_size: int  # the longest sequence
    n_layer: int
    n_head: int
    n_kv_head: int  # grouped-query attention: n_head / n_kv_head query heads share a key/value head
    n_embd: int
    intermediate_size: int  # the SwiGLU MLP's hidden width
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    checkpoint_activations: bool = False


# GPT-2 vocab 50257 padded up to 50304 (a multiple of 64); the small ones are byte-level.
# llama-1b and llama-8b: the shapes of Llama 3.2 1B and Llama 3.1 8B.
CONFIGS: dict[str, GPTConfig | LlamaConfig] = {
    "gpt2": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(vocab_size=50304, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
    "small": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),
    "llama-tiny": LlamaConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                              intermediate_size=176, tie_embeddings=True),
    "llama-small": LlamaConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_kv_head=2, n_embd=128,
                               intermediate_size=352, tie_embeddings=True),
    "llama-1b": LlamaConfig(vocab_size=128256, block_size=131072, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048,
                            intermediate_size=8192, rope_theta=500000.0, tie_embeddings=True),
    "llama-8b": LlamaConfig(vocab_size=128256, block_size=131072, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                            intermediate_size=14336, rope_theta=500000.0),
}


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = _dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # -1 heads, not n_head: under tensor parallelism a rank computes its own heads only
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        q, k, v = (t.view(B, T, -1, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = _dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = config
        self.seed = seed
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = _dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, named "wte.weight"
        for name, p in self.named_parameters():
            if not p.is_meta:
                self.init_parameter(name, p)

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Fill `tensor` in place with the initial value of parameter `name`.

        The value depends only on (self.seed, name): it is drawn in fp32 on a
        CPU generator, then copied into `tensor` (any device, any float dtype).
        """
        if name == "lm_head.weight":
            name = "wte.weight"  # the tied head is the token embedding
        module_name, _, kind = name.rpartition(".")
        if kind == "bias":
            tensor.zero_()
        elif module_name.rpartition(".")[2].startswith("ln_"):
            tensor.fill_(1.0)  # LayerNorm weight
        else:
            residual = name.endswith((".c_proj.weight", ".experts.c_proj"))  # residual projections, scaled by depth
            normal_(tensor, self.seed, name, 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        assert T <= self.config.block_size, f"sequence of {T} > block_size {self.config.block_size}"
        # position_ids: where these tokens sit in the sequence (a rank's share of it, under context parallelism)
        pos = torch.arange(T, device=idx.device) if position_ids is None else position_ids
        x = self.drop(self.wte(idx) + self.wpe(pos))
        x = run_blocks(self, self.blocks, x)
        return logits_or_loss(self.lm_head(self.ln_f(x)), targets)


def normal_(tensor, seed, name, std):
    """Fill `tensor` with N(0, std²) values that depend only on (seed, name):
    drawn in fp32 on a CPU generator, then copied (any device, any float dtype)."""
    g = torch.Generator(device="cpu")  # it uses only 32 bits of a seed: hash to 32
    g.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    tensor.copy_(torch.empty(tensor.shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=g))


def run_blocks(model, blocks, x):
    """x through each block; under checkpoint_activations (training with grad),
    each block's activations are recomputed in backward instead of kept."""
    for block in blocks:
        if model.config.checkpoint_activations and model.training and torch.is_grad_enabled():
            x = checkpoint(block, x, use_reentrant=False)
        else:
            x = block(x)
    return x


def logits_or_loss(logits, targets):
    """The logits, or with targets the mean cross-entropy (in fp32)."""
    if targets is None:
        return logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope(q, k, theta):
    """Rotary position embedding as Hugging Face's Llama applies it: the pair
    (i, i + d/2) of each head's d dimensions is rotated by position × θ^(-2i/d),
    computed in fp32 for positions 0..T-1 (nothing is kept between calls)."""
    T, d = q.shape[-2], q.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=q.device) / d)
    angles = torch.arange(T, dtype=torch.float32, device=q.device)[:, None] * inv_freq  # (T, d/2)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0 and config.n_head % config.n_kv_head == 0
        self.config = config
        self.head_dim = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        heads = lambda t, n: t.view(B, T, n, self.head_dim).transpose(1, 2)  # noqa: E731
        q = heads(self.q_proj(x), self.config.n_head)
        k = heads(self.k_proj(x), self.config.n_kv_head)
        v = heads(self.v_proj(x), self.config.n_kv_head)
        q, k = rope(q, k, self.config.rope_theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The model without its head: Hugging Face's "model." in every name."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig, seed: int = 0):
        super().__init__()
        self.config = config
        self.seed = seed
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one tensor, "model.embed_tokens.weight"
        for name, p in self.named_parameters():
            if not p.is_meta:
                self.init_parameter(name, p)

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Fill `tensor` in place with the initial value of parameter `name`
        (as GPT.init_parameter: it depends only on (self.seed, name))."""
        if name == "lm_head.weight" and self.config.tie_embeddings:
            name = "model.embed_tokens.weight"
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)  # RMSNorm weight
        else:
            residual = name.endswith((".o_proj.weight", ".down_proj.weight"))  # scaled by depth, as GPT's
            normal_(tensor, self.seed, name, 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        assert T <= self.config.block_size, f"sequence of {T} > block_size {self.config.block_size}"
        x = run_blocks(self, self.model.layers, self.model.embed_tokens(idx))
        return logits_or_loss(self.lm_head(self.model.norm(x)), targets)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT's loss: the mean cross-entropy over every token (in fp32)."""
    return logits_or_loss(logits, targets)


class Embeddings(nn.Module):
    """GPTSequential's first child: token and position embeddings."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = _dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class Head(nn.Module):
    """GPTSequential's last child: the final LayerNorm and the logits."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class SequentialBlock(Block):
    """A Block of GPTSequential: recomputed in backward under
    config.checkpoint_activations, as GPT.forward does it."""

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.checkpoint_activations = config.checkpoint_activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations and self.training and torch.is_grad_enabled():
            return checkpoint(super().forward, x, use_reentrant=False)
        return super().forward(x)


class GPTSequential(nn.Sequential):
    """The same GPT as an nn.Sequential of blocks, for pipeline parallelism
    (tiny_zero.pipeline cuts it into stages): Embeddings, a Block per layer,
    Head, children "0" to "n_layer + 1"; seq(idx) gives the logits, and
    loss_fn(logits, targets) GPT's loss. The head is tied to wte as in GPT.

    The same parameters as GPT, with the same initial values and the same
    state_dict keys: state_dict() and load_state_dict() speak GPT's names
    ("wte.weight", "blocks.0.attn.c_attn.weight", ...), so the two load each
    other's weights; named_parameters() gives the sequence's own ("0.wte.weight",
    "1.attn.c_attn.weight", ...; gpt_name() turns one into the other).
    """

    def __init__(self, config: GPTConfig, seed: int = 0):
        blocks = (SequentialBlock(config) for _ in range(config.n_layer))
        super().__init__(Embeddings(config), *blocks, Head(config))
        self.config = config
        self.seed = seed
        self[-1].lm_head.weight = self[0].wte.weight  # tied
        self.register_state_dict_post_hook(_to_gpt_keys)
        self.register_load_state_dict_pre_hook(_from_gpt_keys)
        for name, p in self.named_parameters():
            if not p.is_meta:
                self.init_parameter(name, p)

    def gpt_name(self, name: str) -> str:
        """GPT's name for one of ours: "0.wte.weight" -> "wte.weight", "1.ln_1.bias" -> "blocks.0.ln_1.bias"."""
        index, _, rest = name.partition(".")
        if int(index) in (0, len(self) - 1):
            return rest
        return f"blocks.{int(index) - 1}.{rest}"

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """GPT's initial value of the parameter GPT names gpt_name(name)."""
        GPT.init_parameter(self, self.gpt_name(name), tensor)


def _to_gpt_keys(module, state_dict, prefix, local_metadata):
    """state_dict() post-hook of GPTSequential: our keys become GPT's, in order."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + module.gpt_name(key[len(prefix):])] = state_dict.pop(key)


def _from_gpt_keys(module, state_dict, prefix, *args):
    """load_state_dict() pre-hook of GPTSequential: GPT's keys become ours."""
    names = [name for name, _ in module.named_parameters(remove_duplicate=False)]
    names += [name for name, _ in module.named_buffers(remove_duplicate=False)]
    ours = {prefix + module.gpt_name(name): prefix + name for name in names}
    for key in [k for k in state_dict if k in ours]:
        state_dict[ours[key]] = state_dict.pop(key)


# ---------------------------------------------------------------- a mixture-of-experts GPT

@dataclass
class MoEGPTConfig(GPTConfig):
    """GPT with a sparse mixture-of-experts MLP in every other block (blocks 1, 3, ...)."""
    n_experts: int = 4
    top_k: int = 2
    aux_loss_coef: float = 0.01  # Switch/Mixtral's load-balancing loss
    z_loss_coef: float = 0.0  # ST-MoE's router z-loss (0: off)


MOE_CONFIGS: dict[str, MoEGPTConfig] = {
    "moe-tiny": MoEGPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
    "moe-small": MoEGPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128, n_experts=8),
}


class Experts(nn.Module):
    """n_experts GPT MLPs as 3-D tensors: expert e is gelu(x c_fc[e]ᵀ) c_proj[e]ᵀ."""

    def __init__(self, config: MoEGPTConfig):
        super().__init__()
        d, n = config.n_embd, config.n_experts
        self.c_fc = nn.Parameter(torch.empty(n, 4 * d, d))
        self.c_proj = nn.Parameter(torch.empty(n, d, 4 * d))
        self.act_fn = nn.GELU(approximate="tanh")

    def forward(self, x, chosen, weights):
        """x (tokens, d); chosen, weights (tokens, top_k): each token's experts and their weights."""
        out = torch.zeros_like(x)
        for e in range(self.c_fc.shape[0]):
            token, slot = torch.where(chosen == e)
            y = F.linear(self.act_fn(F.linear(x[token], self.c_fc[e])), self.c_proj[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
        return out


class MoE(nn.Module):
    """Mixtral's sparse MoE: a softmax router, each token to its top_k experts, their outputs weighted by
    the router's probabilities renormalised over the top_k."""

    def __init__(self, config: MoEGPTConfig):
        super().__init__()
        self.top_k = config.top_k
        self.router = nn.Linear(config.n_embd, config.n_experts, bias=False)
        self.experts = Experts(config)
        self.router_logits = None  # the last forward's, for the auxiliary losses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        self.router_logits = self.router(h)
        weights, chosen = torch.topk(F.softmax(self.router_logits.float(), dim=-1), self.top_k, dim=-1)
        return self.experts(h, chosen, weights / weights.sum(dim=-1, keepdim=True)).view(x.shape)


class MoEGPT(GPT):
    """GPT whose odd blocks' MLP is an MoE. With targets, the loss adds
    aux_loss_coef x the load-balancing loss (and z_loss_coef x the z-loss)."""

    def __init__(self, config: MoEGPTConfig, seed: int = 0):
        nn.Module.__init__(self)
        with torch.device("meta"):  # the GPT's layout, then the MoE MLPs in place; values once, below
            GPT.__init__(self, config, seed)
        self.moe_blocks = list(range(1, config.n_layer, 2))
        for i in self.moe_blocks:
            self.blocks[i].mlp = MoE(config)
        self.to_empty(device=torch.get_default_device())
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if not p.is_meta:
                self.init_parameter(name, p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().forward(idx, None, position_ids)
        if targets is None:
            return logits
        c = self.config
        router_logits = tuple(self.blocks[i].mlp.router_logits for i in self.moe_blocks)
        loss = logits_or_loss(logits, targets) + c.aux_loss_coef * load_balancing_loss_func(
            router_logits, c.n_experts, c.top_k)
        if c.z_loss_coef:
            loss = loss + c.z_loss_coef * router_z_loss_func(router_logits)
        return loss


def load_balancing_loss_func(gate_logits, num_experts, top_k=2, attention_mask=None):
    """Switch/Mixtral's: num_experts x sum_e (share of the top-k picks for e) x (mean probability of e),
    over every layer's tokens. Hugging Face's name and arguments (attention_mask: unused here)."""
    probs = F.softmax(torch.cat(gate_logits).float(), dim=-1)
    picks = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, num_experts).sum(dim=(0, 1)).float()
    return num_experts * (picks / len(probs) * probs.mean(dim=0)).sum()


def router_z_loss_func(gate_logits):
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)²."""
    return (torch.logsumexp(torch.cat(gate_logits).float(), dim=-1) ** 2).mean()


def build_model(name_or_config: str | GPTConfig | LlamaConfig, seed: int = 0, device=None,
                **overrides) -> GPT | Llama:
    """GPT or Llama from a CONFIGS name or a config; overrides replace config fields.

    With device="meta" the model is built instantly and allocates nothing.
    """
    if isinstance(name_or_config, str):
        known = {**CONFIGS, **MOE_CONFIGS}
        if name_or_config not in known:
            raise ValueError(f"unknown model {name_or_config!r}; choose from {', '.join(known)}")
        name_or_config = known[name_or_config]
    config = replace(name_or_config, **overrides)
    cls = Llama if isinstance(config, LlamaConfig) else MoEGPT if isinstance(config, MoEGPTConfig) else GPT
    if device is None:
        return cls(config, seed=seed)
    with torch.device(device):
        return cls(config, seed=seed)


def count_parameters(model: nn.Module) -> int:
    """Number of unique parameter elements (the tied head is counted once)."""
    return sum(p.numel() for p in model.parameters())


def build_sequential(name_or_config: str | GPTConfig, seed: int = 0, device=None, **overrides) -> GPTSequential:
    """GPTSequential from a CONFIGS name or a GPTConfig, as build_model builds GPT."""
    config = build_model(name_or_config, device="meta", **overrides).config  # the same names and overrides
    if device is None:
        return GPTSequential(config, seed=seed)
    with torch.device(device):
        return GPTSequential(config, seed=seed)
