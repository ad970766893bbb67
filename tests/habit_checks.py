"""Worker functions for tests/test_habits.py: what torch and Hugging Face
users call on a wrapped model (run on every rank). Each check returns its
failures as a list of strings."""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import tiny_zero
from hf_checks import build
from parity_checks import wrap


def generate_as_torch(names):
    """model.generate on the wrapper (forwarded to the Hugging Face module)
    gives torch's greedy tokens. Each rank asks for another number of new
    tokens, so one rank finishes first and must go on running forwards while
    the other does (synced_gpus, where every forward sends collectives)."""
    failures = []
    rank = dist.get_rank()
    prompts = torch.tensor([[1, 5, 7, 9], [2, 3, 4, 6]]) + rank
    options = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=3 + 3 * rank, do_sample=False,
                   pad_token_id=0)
    reference = build("llama").eval()
    want = reference.generate(prompts, **options)
    for name in names:
        model = wrap(name, copy.deepcopy(reference))
        got = model.generate(prompts, **options)
        if not torch.equal(got, want):
            failures.append(f"{name}: model.generate gave {got.tolist()}, torch {want.tolist()}")
        if model.config is not model.module.config:
            failures.append(f"{name}: model.config is not the module's")
        model.gradient_checkpointing_enable()
        if not any(getattr(m, "gradient_checkpointing", False) for m in model.module.modules()):
            failures.append(f"{name}: model.gradient_checkpointing_enable() did not reach the module")
        try:  # it would write into parameters that hold only this rank's part
            model.resize_token_embeddings(80)
            failures.append(f"{name}: model.resize_token_embeddings was forwarded")
        except AttributeError as e:
            if "model.module.resize_token_embeddings" not in str(e):
                failures.append(f"{name}: unclear error {e}")
        try:
            model.no_such_attribute
            failures.append(f"{name}: model.no_such_attribute did not raise")
        except AttributeError as e:
            if "model.module" in str(e):
                failures.append(f"{name}: an attribute the module lacks is told to be the module's: {e}")
    return failures


class Regression(nn.Module):
    """Float inputs and a float target, as a regression script passes them."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x, target):
        return (self.fc2(torch.tanh(self.fc1(x))).float() - target.float()).square().mean()


def float32_inputs_under_mixed_precision(cases):
    """Under bf16 and fp16 a float32 batch is cast to the parameters' dtype as
    it enters the model, as FSDP2 casts it: the loss, and the parameters after
    two steps, equal those of a batch given in that dtype."""
    failures = []
    g = torch.Generator().manual_seed(dist.get_rank())
    x, target = torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)
    for name, mixed_precision in cases:
        states = []
        for batch in [(x, target), (x.to(tiny_zero.precision.DTYPES[mixed_precision]), target)]:
            wrapper_cls, opt_cls = tiny_zero.STRATEGIES[name]
            torch.manual_seed(0)
            model = wrapper_cls(Regression(), mixed_precision=mixed_precision)
            opt = opt_cls(model, lr=1e-2)
            losses = []
            for _ in range(2):
                try:
                    loss = model(*batch)
                except RuntimeError as e:
                    failures.append(f"{name} {mixed_precision}: {batch[0].dtype} inputs: {e}")
                    return failures
                model.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            states.append((losses, model.full_state_dict()))
        (losses, state), (want_losses, want) = states
        if losses != want_losses or any(not torch.equal(state[k], want[k]) for k in want):
            failures.append(f"{name} {mixed_precision}: a float32 batch trains otherwise than one in "
                            f"{mixed_precision} (losses {losses} vs {want_losses})")
    return failures
