"""Expert parallelism (tiny_zero.experts) equals single-process torch.

The example MoE GPT (top-2 of 4 experts, with the load-balancing and z
losses) and Hugging Face Mixtrals (top-2 of 4 and of 8) train under
ExpertParallel as torch trains them on one process on the whole batch: the
logits, the loss with its auxiliary terms, every parameter after AdamW
steps; also with so few tokens that a rank routes none to some expert,
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
from harness import run_checks  # noqa: E402


def check(results):
    for key, per_rank in results.items():
        if key == "refused experts":
            assert all("3 experts do not split over ep_size=2" in message for message in per_rank), per_rank
        elif key == "refused size":
            assert all("ep_size=3 must divide the world size 2" in message for message in per_rank), per_rank
        else:
            for rank, failures in enumerate(per_rank):
                assert not failures, f"{key}, rank {rank}: {failures}"


def test_world2():
    check(run_checks(2, "experts_checks", [
        ("gpt", "model_parity", ("gpt", 2)),
        ("gpt ep=1 x 2 replicas", "model_parity", ("gpt", 1)),
        ("mixtral top-2 of 4", "model_parity", ("mixtral4", 2)),
        ("mixtral top-2 of 8 over zero2", "model_parity", ("mixtral8", 2, 3, "zero2")),
        ("starved", "model_parity", ("mixtral8", 2, 3, "ddp", 1, 2, True)),
        ("no_sync and clip", "accumulate_and_clip", ("gpt", 2)),
        ("estimate gpt", "estimate_holds", ("gpt", 2)),
        ("estimate mixtral", "estimate_holds", ("mixtral8", 2)),
        ("refused experts", "refused", ("mixtral3", 2)),
        ("refused size", "refused", ("gpt", 3)),
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
