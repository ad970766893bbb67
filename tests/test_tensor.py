"""Tensor parallelism (tiny_zero.tensor) equals single-process torch, holds
1/T of the planned weights and their optimizer state, and sends exactly the
all-reduces of Megatron's formula.

Three worlds, in the order the checkpoint goes round: 4 ranks (tp 4, and tp 2
x 2 replicas, which saves), 3 (fsdp loads it and saves), 2 (tp 2, which loads
that back). The example script's run is in tests/test_examples.py."""
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from harness import run_checks  # noqa: E402
from tensor_checks import BLOCKS, TPNet, WIDTH, split_names  # noqa: E402

FLOAT_BYTES = 4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Where the worlds save checkpoints for each other to load."""
    return tmp_path_factory.mktemp("tensor")


@pytest.fixture(scope="module")
def world4(root):
    return root, run_checks(4, "tensor_checks", [
        ("parity4", "parity", (4, ["plain", "clip", "no_sync"])),
        ("parity2x2", "parity", (2, ["plain", "eps1", "clip", "no_sync"])),
        ("comm4", "comm_per_step", (4,)),
        ("comm2x2", "comm_per_step", (2,)),
        ("pieces2x2", "pieces_cover_the_model", (2,)),
        ("checkpoint", "save_and_resume", (str(root), 2)),
    ], timeout=600)


@pytest.fixture(scope="module")
def world3(world4):
    root, _ = world4
    return run_checks(3, "tensor_checks", [("fsdp", "load_into_fsdp", (str(root),))])


@pytest.fixture(scope="module")
def back2(root, world3):
    """World 2 loads what fsdp at world 3 saved."""
    return run_checks(2, "tensor_checks", [("back", "load_back", (str(root), 2))])


@pytest.fixture(scope="module")
def world2():
    from example.tensor.train import PLAN as GPT_PLAN
    return run_checks(2, "tensor_checks", [
        ("parity2", "parity", (2, ["plain", "eps1", "clip", "no_sync"])),
        ("comm2", "comm_per_step", (2,)),
        ("memory2", "memory", (2,)),
        ("pieces2", "pieces_cover_the_model", (2,)),
        ("loop", "training_loop", (2,)),
        ("state_dicts", "state_dicts", (2,)),
        ("in_place_writes", "in_place_writes", (2,)),
        ("precision", "precision", (2,)),
        ("gpt", "example_gpt", (GPT_PLAN, False)),
        ("gpt_checkpointed", "example_gpt", (GPT_PLAN, True)),
        ("bad", "bad_plans", ()),
        ("refused", "refused_plans", ()),
        ("llama", "llama_megatron", ()),
    ], timeout=600)


def no_failures(per_rank):
    failures = [f for rank in per_rank for f in rank]
    assert not failures, "\n".join(failures[:30])


@pytest.mark.slow
@pytest.mark.parametrize("key", ["parity4", "parity2x2"])
def test_parity_at_world_4(world4, key):
    """tp 4, and tp 2 x 2 replicas: losses within rtol 1e-5 and every parameter
    within 1e-4 of torch after every step, in every mode; the whole parameters'
    grads are bitwise equal on every rank of a tensor group, the slices' not."""
    no_failures(world4[1][key])


def test_parity_at_world_2(world2):
    no_failures(world2["parity2"])


def test_the_example_gpt_with_its_plan(world2):
    """Its fused c_attn split in 3 parts; also with activation checkpointing."""
    no_failures(world2["gpt"] + world2["gpt_checkpointed"])


def test_torch_training_loop_semantics(world2):
    no_failures(world2["loop"] + world2["state_dicts"])


def test_a_parameter_written_in_place(world2):
    """fp32: the write lasts; bf16: every rank raises at the step."""
    no_failures(world2["in_place_writes"])


def test_mixed_precision(world2):
    no_failures(world2["precision"])


def formula(tokens, held, buckets, replicas, bytes_per=FLOAT_BYTES):
    """Megatron's, per step: in forward the output of each block's two row
    Linears (o, down), in backward the input grad of its two column groups
    (q, k, v reading one input; up), each tokens x WIDTH; across replicas
    the grads a rank holds, bucket by bucket; the clip's one scalar."""
    activations = tokens * WIDTH
    forward = {"all_reduce": 2 * BLOCKS}, {"all_reduce": 2 * BLOCKS * activations * bytes_per}
    sent = replicas > 1
    backward = ({"all_reduce": 2 * BLOCKS + buckets * sent},
                {"all_reduce": (2 * BLOCKS * activations + held * sent) * bytes_per})
    after = {"all_reduce": 1}, {"all_reduce": bytes_per}
    return dict(forward=forward, backward=backward, after=after)


def results(request, world):
    """The checks of the world a test names: world 2 in the quick tier, world 4 in the full grid."""
    return request.getfixturevalue("world4")[1] if world == 4 else request.getfixturevalue("world2")


@pytest.mark.parametrize("world,key", [pytest.param(4, "comm4", marks=pytest.mark.slow),
                                       pytest.param(4, "comm2x2", marks=pytest.mark.slow), (2, "comm2")])
def test_communication_is_the_formula(world, key, request):
    """Calls and bytes of every collective, in forward, backward and after,
    on every rank, exactly."""
    per_rank = results(request, world)[key]
    for rank, r in enumerate(per_rank):
        want = formula(r["tokens"], r["held"], r["buckets"], r["replicas"])
        got = {part: r[part] for part in ("forward", "backward", "after")}
        assert got == want, (rank, got, want)


def test_memory_is_one_T_of_the_planned_weights(world2):
    """Per rank, after a step: 4 bytes of parameter, 4 of grad and 8 of AdamW
    state for each element held, where a rank holds 1/T of each split
    parameter and the others whole (step counts are Python ints; neither
    releases a parameter, so neither makes the shared zero that released
    parameters point at); ddp, measured alike, holds as much for every
    element of the model."""
    module = TPNet()
    full = {name: p.numel() for name, p in module.named_parameters()}
    split = set(split_names(module))
    for rank, r in enumerate(world2["memory2"]):
        assert r["elements"] == {n: full[n] // 2 if n in split else full[n] for n in full}, rank
        held = sum(r["elements"].values())
        assert r["held"]["tensor"] == {"parameters": 4 * held, "gradients": 4 * held,
                                       "optimizer_state": 8 * held}, rank
        everything = sum(full.values())
        assert r["held"]["ddp"] == {"parameters": 4 * everything, "gradients": 4 * everything,
                                    "optimizer_state": 8 * everything}, rank
        print(f"rank {rank}: tensor {sum(r['held']['tensor'].values())} bytes, ddp {sum(r['held']['ddp'].values())}")


@pytest.mark.parametrize("world,key", [pytest.param(4, "pieces2x2", marks=pytest.mark.slow), (2, "pieces2")])
def test_pieces_cover_every_element_once(world, key, request):
    no_failures(results(request, world)[key])


@pytest.mark.slow
def test_checkpoint_goes_round(world4, world3, back2):
    """tp 2 x 2 saves; its own resume is bit-identical; fsdp at 3 ranks loads
    it and trains on as torch does, and saves; tp 2 loads that and trains on
    as torch does."""
    no_failures(world4[1]["checkpoint"] + world3["fsdp"] + back2["back"])


@pytest.mark.parametrize("case,message", [
    ("column", r"0: a column split cuts its 5 output features into 1 part\(s\) of tp_size=2 slices"),
    ("row", r"0: a row split cuts its 5 input features"),
    ("parts", r"cuts its 8 output features into 3 part\(s\)"),
    ("kind", r"give 'column', 'row', or \(one of them, parts\)"),
    ("nothing", r"'\*\.query' matches no module; the Linears are named blocks\.0\.attn\.q"),
    ("not_linear", r"matches blocks\.0\.ln1 \(LayerNorm\): only nn\.Linear"),
    ("tied", r"head shares a parameter with another layer \(tied weights\)"),
    ("two_ways", r"blocks\.0\.attn\.q is matched by two patterns"),
    ("tp_size", r"tp_size=3 must divide the world size 2"),
])
def test_bad_plans_raise_before_anything_is_sent(case, message, world2):
    error = world2["bad"][0][case]
    assert error is not None and re.search(message, error), error


@pytest.mark.parametrize("case,message", [
    ("q_and_o_only", r"^model\.layers\.0\.self_attn\.k_proj is whole, but model\.layers\.0\.self_attn splits "
                     r"q_proj \(column\), o_proj \(row\).* Add 'model\.layers\.0\.self_attn\.k_proj': 'column'"),
    ("lm_head_column", r"^lm_head split by column, but no row Linear follows in the wrapped module.*"
                       r"its own slice of it\. Leave lm_head whole"),
    ("kv_heads", r"^model\.layers\.0\.self_attn has num_key_value_heads=1, which tp_size=2 does not divide.*"
                 r"Use a tp_size that divides every head count"),
    ("norm_of_heads", r"^model\.layers\.0\.self_attn\.q_norm \(Qwen3RMSNorm\) holds parameters inside "
                      r"model\.layers\.0\.self_attn.*its grads would differ between the ranks\. Leave"),
    ("column_alone", r"^blocks\.0\.down is whole, but blocks\.0 splits up \(column\).* Add 'blocks\.0\.down': 'row'"),
    ("row_alone", r"^blocks\.0\.up is whole, but blocks\.0 splits down \(row\).* Add 'blocks\.0\.up': 'column'"),
    ("row_first", r"^blocks\.0\.mlp\.c_fc is split by row, but no column Linear comes before it in blocks\.0\.mlp.*"
                  r"Split the Linear that feeds blocks\.0\.mlp\.c_fc by 'column'"),
])
def test_a_plan_that_cannot_be_right_is_refused(case, message, world2):
    """q, k and v split unlike, a column without its row or a row without its
    column, a column output that reaches the loss, heads that tp_size does not
    divide, a layer with parameters among an attention's heads: every rank
    raises the same error, naming the module and what to change, at wrap
    time, before anything is sent."""
    errors = [rank[case] for rank in world2["refused"]]
    assert errors[0] is not None and re.search(message, errors[0]), errors[0]
    assert all(e == errors[0] for e in errors), errors
    assert [rank[f"{case} sent"] for rank in world2["refused"]] == [0, 0]


def test_hugging_face_llama_with_megatrons_plan(world2):
    """q, k, v and gate, up by column, o and down by row, the head whole:
    torch's losses and parameters after every step."""
    no_failures(world2["llama"])
