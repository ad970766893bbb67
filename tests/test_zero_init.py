"""tiny_zero.zero.Init and GatheredParameters, as DeepSpeed's: a model built under Init holds
1/N of its parameters on each rank, equals the model built whole, and trains alike at every
stage (one spawned world of 2)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from harness import run_checks  # noqa: E402

STAGES = [0, 2, 3]


@pytest.fixture(scope="module")
def world():
    plan = [("built", "built_alike", ()), ("modifier", "modifier", ()), ("trains", "trains_alike", (STAGES,))]
    return run_checks(2, "zero_init_checks", plan, timeout=300)


@pytest.mark.slow  # a spawned world of 2: about 10 s
def test_a_model_built_under_init_holds_half_and_equals_the_whole_one(world):
    for result in world["built"]:
        assert result["all_meta"] and result["late_cut"] and result["tied"]
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
