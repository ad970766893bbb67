"""What torch and Hugging Face users call on a wrapped model, on 2 ranks:

- model.generate (and the module's config, gradient_checkpointing_enable)
  reach the Hugging Face module and give torch's tokens under zero3 and fsdp,
  with ranks that finish at different lengths; what could write into a
  parameter outside a forward is not forwarded, and its error says
  model.module.<name>.
- A float32 batch under bf16 and fp16 is cast as it enters the model, and
  trains as a batch given in that dtype.

torch.nn.utils.clip_grad_norm_(model.parameters()) on a strategy that keeps
grads sharded raises an error naming model.clip_grad_norm_
(tests/semantics_checks.py: grads_as_torch_sees_them)."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from harness import run_checks  # noqa: E402

PLAN = [("generate", "generate_as_torch", (["ddp", "zero3", "fsdp"],)),
        ("float32 inputs", "float32_inputs_under_mixed_precision",
         ([("ddp", "fp16"), ("zero3", "bf16"), ("fsdp", "fp16"), ("zero2", "bf16")],))]


@pytest.fixture(scope="module")
def world2():
    return run_checks(2, "habit_checks", PLAN)


@pytest.mark.parametrize("check", [key for key, _, _ in PLAN])
def test_habits_on_a_wrapped_model(world2, check):
    failures = [f for rank in world2[check] for f in rank]
    assert not failures, "\n".join(failures)
