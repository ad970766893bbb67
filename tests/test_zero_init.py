"""tiny_zero.zero.Init and GatheredParameters, as DeepSpeed's: a model built under Init holds
1/N of its parameters on each rank, equals the model built whole, and trains alike at every
stage (one spawned world of 2)."""
import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from harness import run_checks  # noqa: E402

STAGES = [0, 2, 3]
HF = importlib.util.find_spec("transformers") is not None
HF_STEPS = 3


@pytest.fixture(scope="module")
def world():
    plan = [("built", "built_alike", ()), ("modifier", "modifier", ()), ("trains", "trains_alike", (STAGES,))]
    plan += [("hf", "hf_alike", (HF_STEPS,))] if HF else []
    return run_checks(2, "zero_init_checks", plan, timeout=300)


@pytest.mark.slow  # a spawned world of 2: about 10 s
def test_a_model_built_under_init_holds_half_and_equals_the_whole_one(world):
    for result in world["built"]:
        assert result["all_meta"] and result["late_cut"] and result["tied"]
        assert result["one_at_a_time"]  # a plain module's child is cut as its own __init__ returns
        assert result["deferred"] == (True, False, True)  # under a post_init: whole until the top one is built
        assert all(result["equal"].values()), result["equal"]
        held, whole = result["held"]
        assert held < 0.6 * whole, (held, whole)  # 1/2, and the padding of each tensor's slice


@pytest.mark.slow
def test_gathered_parameters_keeps_the_modifier_ranks_writes_only(world):
    for values in world["modifier"]:
        assert values == [0.5] * 12


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_a_model_built_under_init_trains_as_the_one_built_whole(world, stage):
    for whole, cut in (rank[stage] for rank in world["trains"]):
        assert whole == cut


@pytest.mark.slow
def test_gathered_parameters_refuses_a_parameter_a_wrapper_holds_in_slices(world):
    for result in world["trains"]:
        assert "held in slices by a tiny_zero wrapper" in result["wrapped"]


@pytest.mark.slow
@pytest.mark.skipif(not HF, reason="transformers is not installed")
def test_a_hugging_face_model_built_under_init_equals_the_whole_one_and_trains_alike(world):
    """Its post_init re-initialises every module after they are built: it must see them whole."""
    for result in world["hf"]:
        assert result["cut"] and result["keys"]
        assert result["differ"] == {}, result["differ"]
        whole, cut = result["losses"]
        assert len(whole) == HF_STEPS and whole == cut
