"""Worker functions for tests/test_zero_init.py (run on every rank): models built under
tiny_zero.zero.Init against the same models built whole."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import tiny_zero
from deepspeed_checks import SEQ, VOCAB, batch, config, train
from tiny_zero.materialize import SLICE

WIDTH = 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.norm(h)))


class Model(nn.Module):
    """Children, a tied head, and a model-wide init after the children are built
    (as transformers' post_init), written as DeepSpeed asks: inside GatheredParameters."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        with tiny_zero.zero.GatheredParameters([self.emb.weight], modifier_rank=0):
            nn.init.normal_(self.emb.weight, std=0.5)

    def forward(self, x, y):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def build(under_init):
    torch.manual_seed(0)
    if not under_init:
        return Model()
    with tiny_zero.zero.Init():
        return Model()


def whole_values(model):
    with tiny_zero.zero.GatheredParameters(model.parameters()):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def held_bytes(model):
    return sum(getattr(p, SLICE).numel() * 4 if hasattr(p, SLICE) else p.numel() * 4 for p in model.parameters())


def built_alike():
    """What Init holds, and whether its model equals the whole one, gathered."""
    whole, cut = build(False), build(True)
    expected = {name: p.detach().clone() for name, p in whole.named_parameters()}
    with tiny_zero.zero.Init():
        class Late(nn.Module):  # a class defined inside the context is cut too
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
                self.cut_at_once = self.fc.weight.is_meta

        class WithPostInit(nn.Module):  # duck-typed as transformers' PreTrainedModel
            def __init__(self):
                super().__init__()
                self.inner = Late()
                self.post_init()

            def post_init(self):
                self.whole_in_post_init = not self.inner.fc.weight.is_meta
        late, deferred = Late(), WithPostInit()
    return {"all_meta": all(p.is_meta for p in cut.parameters()), "late_cut": late.fc.weight.is_meta,
            "held": (held_bytes(cut), held_bytes(whole)),
            "equal": {name: torch.equal(v, expected[name]) for name, v in whole_values(cut).items()},
            "tied": cut.head.weight is cut.emb.weight, "one_at_a_time": late.cut_at_once,
            "deferred": (deferred.whole_in_post_init, deferred.inner.cut_at_once, deferred.inner.fc.weight.is_meta)}


def modifier():
    """GatheredParameters' modifier_rank: rank 0's writes kept on every rank; without one, dropped."""
    model = build(True)
    scale = model.blocks[0].norm.weight
    with tiny_zero.zero.GatheredParameters([scale], modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            scale.data.fill_(0.5)
    with tiny_zero.zero.GatheredParameters([scale]):
        scale.data.fill_(7.0)
    return whole_values(model)["blocks.0.norm.weight"].tolist()


def trains_alike(stages):
    """{stage: (losses built whole, losses built under Init)} through tiny_zero.initialize; and
    what GatheredParameters says of a parameter that stage 3 holds in slices."""
    out = {}
    for stage in stages:
        runs = []
        for under_init in (False, True):
            engine, _, _, _ = tiny_zero.initialize(model=build(under_init), config=config(stage))
            runs.append(train(engine, 4))
        out[stage] = runs
    try:
        tiny_zero.zero.GatheredParameters([engine.module.emb.weight])
        out["wrapped"] = None
    except ValueError as e:
        out["wrapped"] = str(e)
    return out


def tiny_llama():
    """A Hugging Face model, whose post_init re-initialises every module after they are built."""
    import transformers as T  # only here: the other checks run without it
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, initializer_range=0.5))


def hf_alike(steps):
    """A tiny Llama built whole and under Init, wrapped at stage 3: (its whole values as wrapped, the
    losses of `steps` steps) for each."""
    runs = []
    for under_init in (False, True):
        torch.manual_seed(0)
        if under_init:
            with tiny_zero.zero.Init():
                model = tiny_llama()
        else:
            model = tiny_llama()
        if under_init:
            all_meta = all(p.is_meta for p in model.parameters())
            tied = model.lm_head.weight is model.model.embed_tokens.weight
        engine, _, _, _ = tiny_zero.initialize(model=model, config=config(3))
        values = engine.wrapper.full_state_dict()
        losses = []
        for i in range(steps):
            x, y = batch(i)
            loss = engine(input_ids=x, labels=y).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs.append((values, losses))
    (whole, whole_losses), (cut, cut_losses) = runs
    return {"differ": {k: (cut[k] - v).abs().max().item() for k, v in whole.items() if not torch.equal(cut[k], v)},
            "keys": sorted(whole) == sorted(cut), "losses": (whole_losses, cut_losses), "cut": all_meta and tied}
