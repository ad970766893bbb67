"""How a model is cut into stages.

    stage_sizes       the children of an nn.Sequential in runs of consecutive
                      children, one run per stage: balanced by parameter
                      count, or as given
    pipeline_stages   a Hugging Face decoder model as such an nn.Sequential:
                      one DecoderStage per stage, cut by decoder layers

tiny_zero never imports transformers: the decoder's parts are found by the
names transformers gives them, and its mask functions in the model's own
module."""
import sys
from functools import cache
from itertools import accumulate

import torch
import torch.nn as nn

from .schedule import SCHEDULES


def stage_sizes(seq, loss_fn, microbatches, schedule, stages, balance, world):
    """The number of children in each stage, or a clear error."""
    if not isinstance(seq, nn.Sequential):
        raise TypeError(f"Pipeline cuts an nn.Sequential into stages, got {type(seq).__name__}: write the model "
                        "as nn.Sequential(...), each child taking the previous one's output (as example/model.py's "
                        "GPTSequential does)")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function loss_fn(output, target), got {type(loss_fn).__name__}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    if not isinstance(stages, int) or stages < 1 or world % stages:
        raise ValueError(f"stages={stages!r} does not divide the world of {world} ranks (W = stages × replicas)")
    if len(seq) < stages:
        raise ValueError(f"the nn.Sequential has {len(seq)} children, fewer than stages={stages}: "
                         "each stage runs one at least")
    if balance is None:
        return balanced([sum(p.numel() for p in child.parameters()) for child in seq], stages)
    if len(balance) != stages or sum(balance) != len(seq) or min(balance) < 1:
        raise ValueError(f"balance={list(balance)} must give each of the {stages} stages one child or more, "
                         f"{len(seq)} in all")
    return list(balance)


def balanced(sizes, stages):
    """Cut the children (sizes: their parameter counts) into `stages` runs of
    one or more, the largest run as small as can be; returns the run lengths."""
    prefix = [0, *accumulate(sizes)]

    @cache
    def best(k, end):  # (largest run, run lengths) for the first `end` children in k runs
        if k == 1:
            return prefix[end], (end,)
        return min((max(best(k - 1, cut)[0], prefix[end] - prefix[cut]), best(k - 1, cut)[1] + (end - cut,))
                   for cut in range(k - 1, end))

    return list(best(stages, len(sizes))[1])


# ---------------------------------------------------------------- a decoder model, cut by layers

def pipeline_stages(model, stages):
    """A Hugging Face decoder model (Llama, Qwen2, Mistral, GPT-2: ...ForCausalLM)
    as an nn.Sequential of `stages` DecoderStage children, its decoder layers
    cut into equal runs (the earlier stages take one more where they do not
    divide): the embeddings on the first stage, the final norm and the head on
    the last. seq(input_ids) is the model's logits; a tied head stays the
    embedding's parameter (Pipeline keeps it tied across the two stages)."""
    parts = decoder_parts(model)
    count = len(parts["layers"])
    if not isinstance(stages, int) or not 1 <= stages <= count:
        raise ValueError(f"stages={stages!r}: {type(model).__name__} has {count} decoder layers, and each stage "
                         "runs one at least")
    sizes = [count // stages + (s < count % stages) for s in range(stages)]
    ends = list(accumulate(sizes))
    return nn.Sequential(*(DecoderStage(model, parts, range(end - n, end), first=s == 0, last=s == stages - 1)
                           for s, (n, end) in enumerate(zip(sizes, ends))))


def decoder_parts(model):
    """{part: module} of a decoder model, found by the names transformers gives them."""
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if prefix else None
    layers = getattr(base, "layers", getattr(base, "h", None))
    head = getattr(model, "lm_head", None)
    if base is None or not isinstance(layers, nn.ModuleList) or head is None:
        raise TypeError(f"pipeline_stages cuts a Hugging Face decoder model with a head (LlamaForCausalLM, "
                        f"Qwen2ForCausalLM, MistralForCausalLM, GPT2LMHeadModel), got {type(model).__name__}")
    return {"embed": base.get_input_embeddings(), "positions": getattr(base, "wpe", None),
            "drop": getattr(base, "drop", None), "rotary": getattr(base, "rotary_emb", None),
            "layers": layers, "norm": getattr(base, "norm", getattr(base, "ln_f", None)), "head": head}


class DecoderStage(nn.Module):
    """Some consecutive decoder layers of a model, with the embeddings before
    them on the first stage and the final norm and head after them on the
    last. Each module keeps its path in the model (model.layers.3 ...), so a
    stage's state_dict keys are the model's.

    Between stages passes a dict: the hidden states (their grads come back),
    the position ids and the attention mask the input came with (forward
    only). Each stage makes the causal masks and the rotary embedding of its
    layers from them, as the model does before its first layer."""

    def __init__(self, model, parts, indices, first, last):
        super().__init__()
        self.config, self.first, self.last = model.config, first, last
        self.indices = list(indices)
        path = {module: name for name, module in model.named_modules()}
        kept = ["embed", "positions", "drop"] * first + ["norm", "head"] * last
        for name in kept + ["rotary"]:
            if parts[name] is not None:
                place(self, path[parts[name]], parts[name])
        for i in self.indices:
            place(self, path[parts["layers"][i]], parts["layers"][i])
        self.parts = {name: parts[name] for name in kept + ["rotary"]}
        self.layers = [parts["layers"][i] for i in self.indices]
        self.masks = sys.modules[type(model).__module__]  # the mask functions the model calls

    def forward(self, x):
        carry = self.embed(x) if self.first else dict(x)
        h, mask = carry["hidden_states"], carry.get("attention_mask")
        masks = {kind: getattr(self.masks, MASK_FUNCTIONS[kind])(
            config=self.config, inputs_embeds=h, attention_mask=mask, cache=None, position_ids=carry["position_ids"])
            for kind in {attention_kind(self.config, i) for i in self.indices}}
        extra = {}
        if self.parts["rotary"] is not None:
            extra["position_embeddings"] = self.parts["rotary"](h, position_ids=carry["position_ids"])
        for i, layer in zip(self.indices, self.layers):
            h = layer(h, attention_mask=masks[attention_kind(self.config, i)], position_ids=carry["position_ids"],
                      **extra)
            h = h[0] if isinstance(h, tuple) else h
        if self.last:
            return self.parts["head"](self.parts["norm"](h))
        return {**carry, "hidden_states": h}

    def embed(self, x):
        """The first stage: input ids (or a dict of input_ids, attention_mask
        and position_ids) to the hidden states, as the model's forward makes them."""
        x = x if isinstance(x, dict) else {"input_ids": x}
        h = self.parts["embed"](x["input_ids"])
        positions = x.get("position_ids")
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        if self.parts["positions"] is not None:  # GPT-2: learned positions
            h = h + self.parts["positions"](positions)
        if self.parts["drop"] is not None:
            h = self.parts["drop"](h)
        carry = {"hidden_states": h, "position_ids": positions}
        if x.get("attention_mask") is not None:
            carry["attention_mask"] = x["attention_mask"]
        return carry


MASK_FUNCTIONS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask"}


def attention_kind(config, index):
    """Which mask layer `index` takes, as the model decides it."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return kinds[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def place(stage, path, module):
    """stage.<path> = module, with empty containers for the names on the way."""
    *outer, name = path.split(".")
    holder = stage
    for part in outer:
        if not hasattr(holder, part):
            holder.add_module(part, nn.Module())
        holder = getattr(holder, part)
    holder.add_module(name, module)
