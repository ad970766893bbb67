"""A Hugging Face causal LM from a local directory, for the examples' --model hf:DIR.

    module = build("path/to/model")     # parameters on the meta device: nothing allocated
    model = Zero3(module)               # any strategy (or swap_layers, on one device)
    tiny_zero.checkpoint.load_pretrained(model, "path/to/model")  # each rank reads what it holds

DIR is what save_pretrained writes (config.json and the weights); nothing is
downloaded. transformers is needed here, never by tiny_zero itself.
"""
from pathlib import Path

import torch.nn as nn

from example.model import logits_or_loss
from tiny_zero.materialize import meta_parameters

BYTES = 256  # the examples' data are bytes: token ids 0..255


def transformers_or_exit():
    try:
        import transformers
    except ImportError:
        raise SystemExit('error: --model hf:DIR needs transformers (pip install -e ".[hf]")') from None
    return transformers


def config(directory):
    """The model's config.json; raises ValueError if the examples cannot feed it."""
    if not (Path(directory) / "config.json").is_file():
        raise ValueError(f"--model hf:{directory}: no config.json there (a directory save_pretrained wrote)")
    transformers = transformers_or_exit()
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except OSError as e:
        raise ValueError(f"--model hf:{directory}: {str(e).splitlines()[0]}") from None
    if config.vocab_size < BYTES:
        raise ValueError(f"--model hf:{directory}: its vocabulary has {config.vocab_size} tokens; the examples "
                         f"feed bytes, which need {BYTES}")
    return config


def block_size(directory):
    """The longest sequence the model takes."""
    c = config(directory)
    return getattr(c, "max_position_embeddings", None) or c.n_positions


class CausalLM(nn.Module):
    """A Hugging Face causal LM called as the example models are:
    forward(idx, targets=None) gives the logits, or the mean cross-entropy.

    The HF model's submodules are registered as this module's own, so every
    parameter keeps its checkpoint name (model.layers.0.self_attn.q_proj.weight):
    load_pretrained reads DIR as it is, and a consolidated checkpoint loads
    back with from_pretrained."""

    def __init__(self, hf_model):
        super().__init__()
        self.__dict__["hf"] = hf_model  # a plain attribute: its children are registered below
        for name, child in hf_model.named_children():
            self.add_module(name, child)

    def train(self, mode=True):
        self.hf.training = mode  # its children follow through this module
        return super().train(mode)

    def forward(self, idx, targets=None):
        return logits_or_loss(self.hf(input_ids=idx, use_cache=False).logits, targets)


def build(directory, checkpoint_activations=False):
    """The model saved in `directory`, its parameters on the meta device (its
    buffers real): load_pretrained gives them their values."""
    transformers = transformers_or_exit()
    with meta_parameters():
        hf_model = transformers.AutoModelForCausalLM.from_config(config(directory))
    if checkpoint_activations:  # each decoder layer recomputed in backward (renamed in transformers 5)
        enable = getattr(hf_model, "activation_checkpointing_enable", None) or hf_model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    return CausalLM(hf_model)
