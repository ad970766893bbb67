"""Pipeline parallelism (tiny_zero.pipeline) equals single-process torch.

On the example GPT as an nn.Sequential (tied wte and head, attention), GPipe
and 1F1B at world 2, 3 and 4, and 2 stages × 2 replicas at world 4: every
loss within rtol 1e-5 and every parameter within 1e-4 of torch's after each
of 5 AdamW steps (clipped too), eval_step's loss, each rank materialising its
stage only. torch's training loop: a frozen layer, param groups, a
scheduler, two train_steps per step, no_sync, no zero_grad. The schedules:
each stage's actions, and the activations held at once, measured. Mixed
precision, checkpoints to and from other strategies and world sizes, and
clear errors on every rank before any collective. Stages that pass tuples and
dicts of tensors, a stage without parameters, and a Hugging Face Llama cut by
decoder layers (pipeline_stages), at world 2 and 4.

Three spawned worlds (2, 4, 3: world 4 loads what world 2 saved, world 3
what world 4 saved) and checks of the schedules in this process.
"""
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from harness import ROOT, run_checks  # noqa: E402
from tiny_zero.pipeline.schedule import (BACKWARD, FORWARD, SCHEDULES, bubble, live_activations,  # noqa: E402
                                         timeline)

ERRORS = {
    "not sequential": r"Pipeline cuts an nn\.Sequential into stages, got Embeddings",
    "fewer children": r"the nn\.Sequential has 1 children, fewer than stages=\d",
    "world not divisible": r"stages=\d does not divide the world of \d ranks",
    "bad balance": r"balance=\[3, 2\] must give each of the \d stages one child or more, 4 in all",
    "unknown schedule": r"schedule must be one of \['1f1b', 'gpipe'\], got 'zb'",
    "batch not divisible": r"train_step: x has 3 rows, which microbatches=4 does not divide",
    "eval batch not divisible": r"eval_step: x has 2 rows, which microbatches=4 does not divide",
}


def plan(world, root, saves=(), loads=()):
    """What every world checks: parity (and 2 stages × 2 replicas at world 4),
    clipped, the errors, and the checkpoints it saves and loads."""
    stages = [None] if world < 4 else [None, 2]
    checks = [(f"parity S={s}", "parity", (["gpipe", "1f1b"], s)) for s in stages]
    return checks + [("clipped", "parity", (["1f1b"], stages[-1], 0.05)),
                     ("errors", "errors", ()),
                     ("checkpoints", "save_and_load", (str(root), saves, loads))]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Where the worlds save checkpoints for each other to load."""
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def world2(root):
    """{check: per-rank results} at world 2 (the quick tier)."""
    return run_checks(2, "pipeline_checks", plan(2, root, saves=[("pipe2", "pipeline", 2), ("zero3", "zero3", None)],
                                                 loads=[("zero3", "pipeline", 2), ("pipe2", "zero2", None)]) + [
        ("stage only", "holds_its_stage_only", ()),
        ("loops 1f1b", "training_loops", ("1f1b",)),
        ("loops gpipe", "training_loops", ("gpipe",)),
        ("grads", "grads_and_state_dicts", ()),
        ("live gpipe", "live_microbatches", ("gpipe", None, 4)),
        ("live 1f1b", "live_microbatches", ("1f1b", None, 4)),
        ("precision", "mixed_precision", ()),
        ("several tensors", "several_tensors", ([("gpipe", 2, [1, 3]), ("1f1b", 2, [3, 1])],)),
        ("no parameters", "stage_without_parameters", (str(root),)),
        ("hf llama", "hf_llama", (2,))])


@pytest.fixture(scope="module")
def world4(root, world2):
    """At world 4; it loads what world 2 saved."""
    return run_checks(4, "pipeline_checks", plan(
        4, root, saves=[("pipe2x2", "pipeline", 2)],
        loads=[("pipe2", "pipeline", 4), ("pipe2", "pipeline", 2), ("pipe2", "fsdp", None)]) + [
        ("loops 2x2", "training_loops", ("1f1b", 2)),
        ("live gpipe", "live_microbatches", ("gpipe", None, 6)),
        ("live 1f1b", "live_microbatches", ("1f1b", None, 6)),
        ("several tensors", "several_tensors", ([("gpipe", 4, [1, 1, 1, 1]), ("1f1b", 4, [1, 1, 1, 1]),
                                                 ("1f1b", 2, [2, 2])],)),
        ("no parameters", "stage_without_parameters", (str(root),)),
        ("hf llama", "hf_llama", (2,))])


@pytest.fixture(scope="module")
def world3(root, world4):
    """At world 3; it loads what world 4 saved."""
    return run_checks(3, "pipeline_checks", plan(
        3, root, loads=[("pipe2x2", "pipeline", 3), ("pipe2x2", "ddp", None)]))


@pytest.fixture
def worlds(request):
    """{world: {check: per-rank results}}, for the worlds a test names in its
    `world` parameter: world 2 alone in the quick tier, 3 and 4 in the full grid."""
    world = request.getfixturevalue("world") if "world" in request.fixturenames else 2
    return {world: request.getfixturevalue(f"world{world}")}


def slow_beyond_2(*cases):
    """Parameters of world 3 and 4 (the first of each case) go to the full grid."""
    return [case if (case[0] if isinstance(case, tuple) else case) == 2
            else pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.slow)
            for case in cases]


def failures(per_rank):
    return [f for rank in per_rank for f in rank]


@pytest.mark.parametrize("world, stages", slow_beyond_2((2, None), (3, None), (4, None), (4, 2)))
def test_parity_with_torch(worlds, world, stages):
    per_rank = worlds[world][f"parity S={stages}"]
    problems = failures(f for f, _ in per_rank)
    assert not problems, "\n".join(problems[:30])
    print(f"world {world}, stages {stages or world}: largest parameter difference "
          f"{max(largest for _, largest in per_rank):.2e}")


@pytest.mark.parametrize("world", slow_beyond_2(2, 4))
def test_clipped_parity_and_global_norm(worlds, world):
    problems = failures(f for f, _ in worlds[world]["clipped"])
    assert not problems, "\n".join(problems[:30])


def test_a_rank_materialises_its_stage_only_and_tied_copies_agree(worlds):
    problems = failures(worlds[2]["stage only"])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world, check", slow_beyond_2((2, "loops 1f1b"), (2, "loops gpipe"), (4, "loops 2x2")))
def test_torch_training_loop_semantics(worlds, world, check):
    problems = failures(worlds[world][check])
    assert not problems, "\n".join(problems[:30])


def test_grads_and_state_dicts(worlds):
    problems = failures(worlds[2]["grads"])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", slow_beyond_2(2, 4))
def test_stages_pass_tuples_and_dicts_of_tensors(worlds, world):
    """A tuple and a dict (ints, a bool, None, a float sent forward only)
    between stages, a stage without parameters whose output is a transpose,
    the length changing from step to step: torch's losses and parameters,
    each layout sent once per shape."""
    problems = failures(worlds[world]["several tensors"])
    assert not problems, "\n".join(problems[:30])


@pytest.mark.parametrize("world", slow_beyond_2(2, 4))
def test_a_stage_without_parameters_trains_and_saves(worlds, world):
    problems = failures(worlds[world]["no parameters"])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", slow_beyond_2(2, 4))
def test_a_hugging_face_llama_cut_by_layers_trains_as_torch(worlds, world):
    """pipeline_stages(llama, 2): 2 stages at world 2, 2 stages × 2 replicas
    at world 4; grouped-query attention, rotary, a tied and an untied head;
    GPipe and 1F1B."""
    problems = failures(worlds[world]["hf llama"])
    assert not problems, "\n".join(problems[:30])


def test_mixed_precision_follows_fp32(worlds):
    problems = failures(worlds[2]["precision"])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", slow_beyond_2(2, 4, 3))
def test_checkpoints_move_between_pipelines_strategies_and_world_sizes(worlds, world):
    problems = failures(worlds[world]["checkpoints"])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", slow_beyond_2(2, 3, 4))
@pytest.mark.parametrize("case", list(ERRORS))
def test_clear_errors_on_every_rank_before_any_collective(worlds, world, case):
    for rank, messages in enumerate(worlds[world]["errors"]):
        expected = ERRORS[case] if isinstance(ERRORS[case], str) else ERRORS[case][min(rank, 1)]
        assert re.search(expected, messages[case]), (rank, messages[case])


@pytest.mark.parametrize("world, microbatches", slow_beyond_2((2, 4), (4, 6)))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_live_activations_are_the_schedules(worlds, world, microbatches, schedule):
    """Measured: 1F1B holds min(S - s, M) micro-batches' activations on stage
    s (min(S, M) on stage 0), GPipe all M."""
    for measured in worlds[world][f"live {schedule}"]:
        stage = measured["stage"]
        expected = live_activations(SCHEDULES[schedule](world, microbatches, stage))
        assert expected == (microbatches if schedule == "gpipe" else min(world - stage, microbatches))
        assert measured["live"] == pytest.approx(expected, abs=0.02), measured
    peaks = {s: [m["peak"] for m in worlds[world][f"live {s}"]] for s in ("gpipe", "1f1b")}
    assert peaks["1f1b"][0] < peaks["gpipe"][0]


# ---------------------------------------------------------------- the schedules, in this process

@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_each_stage_runs_every_microbatch_forward_then_backward(schedule):
    for stages in range(1, 6):
        for microbatches in range(1, 10):
            for stage in range(stages):
                actions = SCHEDULES[schedule](stages, microbatches, stage)
                forwards = [m for kind, m in actions if kind == FORWARD]
                backwards = [m for kind, m in actions if kind == BACKWARD]
                assert forwards == backwards == list(range(microbatches)), actions
                assert all(actions.index((FORWARD, m)) < actions.index((BACKWARD, m)) for m in forwards)
            timeline(SCHEDULES[schedule], stages, microbatches)  # raises if the stages would wait on each other


def test_the_schedules_in_order():
    """Printed with -s; stage 0 of 1F1B warms up with S - 1 forwards, then alternates."""
    for schedule in SCHEDULES:
        print(f"\n{schedule}, S=4, M=6")
        for stage in range(4):
            print(f"  stage {stage}:", " ".join(f"{k}{m}" for k, m in SCHEDULES[schedule](4, 6, stage)))
    F, B = FORWARD, BACKWARD
    assert SCHEDULES["1f1b"](4, 6, 0) == [(F, 0), (F, 1), (F, 2), (F, 3), (B, 0), (F, 4), (B, 1), (F, 5), (B, 2),
                                          (B, 3), (B, 4), (B, 5)]
    assert SCHEDULES["1f1b"](4, 6, 3) == [x for m in range(6) for x in ((F, m), (B, m))]
    assert SCHEDULES["gpipe"](4, 6, 1) == [(F, m) for m in range(6)] + [(B, m) for m in range(6)]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_timeline_idles_as_the_bubble_formula_says(schedule):
    for stages, microbatches in ((2, 1), (2, 4), (4, 8), (3, 5)):
        rows = timeline(SCHEDULES[schedule], stages, microbatches).splitlines()
        for row in rows:
            cells = row.split()[2:]
            assert cells.count(".") / len(cells) == pytest.approx(bubble(stages, microbatches))


def test_the_pictures_on_the_page_are_the_schedules():
    """docs/pipeline.md's text block: what timeline() draws for S=4, M=6."""
    page = (ROOT / "docs" / "pipeline.md").read_text()
    drawn = "\n".join(f"{name}\n{timeline(SCHEDULES[name], 4, 6)}" for name in ("gpipe", "1f1b"))
    assert f"```text\n{drawn}\n```" in page


def test_the_example_gpt_as_a_sequential_is_the_gpt():
    """example/model.py: GPTSequential has GPT's parameters, initial values
    (built normally or on meta) and state_dict keys, computes the same loss,
    and the two load each other's state dicts."""
    import torch
    from example.model import build_model, build_sequential, loss_fn

    gpt, seq = build_model("tiny"), build_sequential("tiny")
    assert list(seq.state_dict()) == list(gpt.state_dict())
    assert all(torch.equal(v, gpt.state_dict()[k]) for k, v in seq.state_dict().items())
    assert seq[-1].lm_head.weight is seq[0].wte.weight
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    assert torch.equal(loss_fn(seq(x), y), gpt(x, y))
    meta = build_sequential("tiny", device="meta")
    for (name, p), value in zip(meta.named_parameters(), seq.parameters()):
        filled = torch.empty(p.shape)
        meta.init_parameter(name, filled)
        assert torch.equal(filled, value), name
    other = build_sequential("tiny", seed=1)
    other.load_state_dict(gpt.state_dict())
    gpt.load_state_dict(other.state_dict())
    assert all(torch.equal(v, seq.state_dict()[k]) for k, v in other.state_dict().items())


@pytest.mark.slow
def test_the_example_prints_the_single_device_losses():
    """torchrun --nproc_per_node 2 example/pipeline/train.py: two stages, the
    batch of one device, its losses (rtol 1e-5), GPipe and 1F1B alike; and
    with --hf, transformers' Llama in two stages, the example Llama's losses."""
    from test_examples import TINY, losses, run_in_process, torchrun

    single = losses(run_in_process("single_device", *TINY, "--steps", "4", "--batch-size", "4"))
    assert len(single) == 4
    for schedule in ("gpipe", "1f1b"):
        out = torchrun("pipeline", *TINY, "--steps", "4", "--batch-size", "4", "--schedule", schedule)
        assert losses(out) == pytest.approx(single, rel=1e-5, abs=0), out
        assert re.search(r"^  stage 1: peak [\d.]+ \w+ \(parameters", out, re.MULTILINE), out
    # --hf: transformers' Llama of llama-tiny's shape and weights, cut by pipeline_stages
    llama = ["--model", "llama-tiny", *TINY[2:], "--steps", "3", "--batch-size", "4"]
    single = losses(run_in_process("single_device", *llama))
    out = torchrun("pipeline", *llama, "--hf")
    assert len(single) == 3 and losses(out) == pytest.approx(single, rel=1e-5, abs=0), out


def test_pipeline_stages_compute_the_decoder_models_logits():
    """pipeline_stages of Llama (tied), Qwen2, Mistral (a sliding window
    shorter than the sequence) and GPT-2 in 1, 2 and 3 stages: the model's
    logits, with and without an attention mask, and the model's state_dict
    keys behind each stage's index; a stage count the layers cannot give
    each stage one of is refused."""
    import torch
    import transformers
    from tiny_zero.pipeline.stages import pipeline_stages

    shape = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    configs = {"llama": transformers.LlamaConfig(**shape, tie_word_embeddings=True),
               "qwen2": transformers.Qwen2Config(**shape),
               "mistral": transformers.MistralConfig(**shape, sliding_window=3),
               "gpt2": transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=3, n_head=4, n_positions=16,
                                               bos_token_id=0, eos_token_id=0)}
    ids = torch.randint(0, 32, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, 3] = 0
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        for stages in (1, 2, 3):
            seq = pipeline_stages(model, stages)
            assert torch.equal(seq(ids), model(ids).logits), (name, stages)
            assert torch.equal(seq({"input_ids": ids, "attention_mask": mask}),
                               model(ids, attention_mask=mask).logits), (name, stages)
            assert sorted(k.split(".", 1)[1] for k in seq.state_dict()) == sorted(model.state_dict()), name
        with pytest.raises(ValueError, match=r"stages=4: .* has 3 decoder layers, and each stage runs one at least"):
            pipeline_stages(model, 4)
