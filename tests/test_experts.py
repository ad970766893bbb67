"""Expert parallelism (tiny_zero.experts) equals single-process torch.

The example MoE GPT (top-2 of 4 experts, with the load-balancing and z
losses) and Hugging Face Mixtrals (top-2 of 4 and of 8) train under
ExpertParallel as torch trains them on one process on the whole batch: the
logits, the loss with its auxiliary terms, every parameter after AdamW
steps; with padding (an attention_mask, which the load-balancing loss
reads); also with so few tokens that a rank routes none to some expert,
with gradient accumulation (no_sync) and a clip of the global norm, and
at world 4 with experts x 2 replicas, over ddp, zero1 and zero2. And
tiny_zero.measure.estimate's expert memory per rank (1/P of the experts)
and all-to-all elements per step are what the wrapper holds and sends.

The quick tier runs one world of 2; world 4 is in the slow tier."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from harness import check_failures, run_checks  # noqa: E402


def check(results):
    check_failures(results, {"refused experts": "3 experts do not split over ep_size=2",
                             "refused shared experts": "also holds ['shared_expert', 'shared_expert_gate']",
                             "refused size": "ep_size=3 must divide the world size 2"})

def test_world2():
    check(run_checks(2, "experts_checks", [
        ("gpt", "model_parity", ("gpt", 2)),
        ("gpt ep=1 x 2 replicas", "model_parity", ("gpt", 1)),
        ("mixtral top-2 of 4", "model_parity", ("mixtral4", 2)),
        ("mixtral with padding", "model_parity", ("mixtral4 padded", 2)),
        ("mixtral top-2 of 8 over zero2", "model_parity", ("mixtral8", 2, 3, "zero2")),
        ("starved", "model_parity", ("mixtral8", 2, 3, "ddp", 1, 2, True)),
        ("no_sync and clip", "accumulate_and_clip", ("gpt", 2)),
        ("estimate gpt", "estimate_holds", ("gpt", 2)),
        ("state dicts, gpt", "state_dict_round_trip", ("gpt",)),
        ("state dicts, mixtral", "state_dict_round_trip", ("mixtral4",)),
        ("estimate mixtral", "estimate_holds", ("mixtral8", 2)),
        ("refused experts", "refused", ("mixtral3", 2)),
        ("refused size", "refused", ("gpt", 3)),
        ("refused shared experts", "refused", ("qwen2moe", 2)),
    ]))


@pytest.mark.slow
def test_world4():
    """Experts over 4 ranks, and experts over 2 x 2 replicas (each expert on
    two ranks, its grads averaged over them), over ddp, zero1 and zero2."""
    check(run_checks(4, "experts_checks", [
        ("gpt ep=4", "model_parity", ("gpt", 4)),
        ("mixtral top-2 of 8, ep=4", "model_parity", ("mixtral8", 4)),
        ("gpt ep=2 x 2", "model_parity", ("gpt", 2)),
        ("mixtral top-2 of 4, ep=2 x 2 over zero1", "model_parity", ("mixtral4", 2, 3, "zero1")),
        ("mixtral top-2 of 8, ep=2 x 2 over zero2", "model_parity", ("mixtral8", 2, 3, "zero2")),
        ("starved ep=2 x 2", "model_parity", ("mixtral8", 2, 3, "ddp", 1, 2, True)),
        ("no_sync and clip, ep=2 x 2 over zero2", "accumulate_and_clip", ("mixtral4", 2, "zero2")),
    ], timeout=600))


def test_the_losses_are_hugging_faces_and_the_examples_on_one_process():
    """tiny_zero.experts' router and losses, outside a wrapper, against
    Mixtral's router and load_balancing_loss_func (with a padding mask too)
    and example/model.py's load-balancing and z losses."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral import modeling_mixtral as hf

    import example.model as example
    from tiny_zero.experts import load_balancing_loss, route, router_z_loss
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(12, 8, generator=g) for _ in range(3))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    for args in [(logits, 8, 2), (logits, 8, 3), (logits, 8, 2, mask)]:
        assert torch.allclose(load_balancing_loss(*args), hf.load_balancing_loss_func(*args), rtol=1e-6)
    assert torch.allclose(load_balancing_loss(logits, 8, 2), example.load_balancing_loss_func(logits, 8, 2))
    assert torch.allclose(router_z_loss(logits), example.router_z_loss_func(logits))
    router = hf.MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2))
    torch.nn.init.normal_(router.weight, generator=g)
    h = torch.randn(12, 16, generator=g)
    got, want = route(router(h)[0], 2), router(h)[1:]
    assert torch.allclose(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_moe_gpt_is_the_gpt_with_an_moe_every_other_block():
    """example/model.py's MoEGPT: the GPT's parameters (the same values, by
    name), a router and 3-D experts in blocks 1, 3, ...; built on meta it
    allocates nothing."""
    import torch

    from example.model import build_model
    moe, gpt = build_model("moe-small"), build_model("small")
    ours, theirs = dict(moe.named_parameters()), dict(gpt.named_parameters())
    assert {n for n in theirs if n not in ours} == {f"blocks.{i}.mlp.{name}.{kind}" for i in (1, 3)
                                                     for name in ("c_fc", "c_proj") for kind in ("weight", "bias")}
    assert all(torch.equal(p, theirs[n]) for n, p in ours.items() if n in theirs)
    assert ours["blocks.3.mlp.experts.c_fc"].shape == (8, 512, 128) and "blocks.2.mlp.router.weight" not in ours
    assert all(p.is_meta for p in build_model("moe-small", device="meta").parameters())


def test_data_parallel_names_the_strategies_it_runs_over():
    from tiny_zero.experts import data_parallel
    from tiny_zero.zero2 import Zero2
    wrapper, adamw = data_parallel("zero2")
    assert issubclass(wrapper, Zero2) and adamw.wrapper is wrapper
    for strategy in ("zero3", "fsdp", "offload"):
        with pytest.raises(ValueError, match="ddp, zero1, zero2"):
            data_parallel(strategy)
