"""A small GPT-2 in plain torch.nn, read top to bottom.

Parameters live only in nn.Embedding, nn.LayerNorm and nn.Linear, so a
distributed wrapper can swap those modules for its own subclasses. Every
parameter's initial value depends only on (seed, parameter name): a model
built on the meta device can be materialised one tensor at a time with
``model.init_parameter(name, tensor)`` and gets exactly the values that a
normally built model has.
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


# GPT-2 vocab 50257 padded up to 50304 (a multiple of 64); the small ones are byte-level.
CONFIGS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(vocab_size=50304, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
    "small": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),
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
            std = 0.02
            if name.endswith(".c_proj.weight"):  # residual projections, scaled by depth
                std = 0.02 / math.sqrt(2 * self.config.n_layer)
            g = torch.Generator(device="cpu")  # it uses only 32 bits of a seed: hash to 32
            g.manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
            value = torch.empty(tensor.shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=g)
            tensor.copy_(value)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        assert T <= self.config.block_size, f"sequence of {T} > block_size {self.config.block_size}"
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            if self.config.checkpoint_activations and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(B * T))


def build_model(name_or_config: str | GPTConfig, seed: int = 0, device=None, **overrides) -> GPT:
    """GPT from a CONFIGS name or a GPTConfig; overrides replace config fields.

    With device="meta" the model is built instantly and allocates nothing.
    """
    if isinstance(name_or_config, str):
        if name_or_config not in CONFIGS:
            raise ValueError(f"unknown model {name_or_config!r}; choose from {', '.join(CONFIGS)}")
        name_or_config = CONFIGS[name_or_config]
    config = replace(name_or_config, **overrides)
    if device is None:
        return GPT(config, seed=seed)
    with torch.device(device):
        return GPT(config, seed=seed)


def count_parameters(model: nn.Module) -> int:
    """Number of unique parameter elements (the tied head is counted once)."""
    return sum(p.numel() for p in model.parameters())
