"""Checks run inside spawned worlds for tests/test_experts.py: expert
parallelism against single-process torch on the whole batch."""
import copy

import torch
import torch.distributed as dist

RTOL, ATOL = 1e-5, 1e-6
MODELS = {"gpt": 4, "mixtral3": 3, "mixtral4": 4, "mixtral4 padded": 4, "mixtral8": 8}  # kind: experts


def differences(name, got, want):
    if torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        return []
    return [f"{name}: max difference {(got - want).abs().max().item():.3g}"]


def parameters_differ(model, reference, when):
    """[failures]: each of the wrapped model's whole tensors against the reference's."""
    full = model.full_state_dict()
    return [f for name, value in reference.state_dict().items() for f in differences(f"{name} {when}", full[name], value)]


def build(kind):
    """The example MoE GPT (top-2 of 4, with the z-loss), or a tiny Mixtral (top-2 of 4 or 8)."""
    if kind == "gpt":
        from example.model import build_model
        return build_model("moe-tiny", z_loss_coef=1e-3, aux_loss_coef=0.1)
    if kind == "qwen2moe":  # shared experts beside the routed ones: refused, not dropped
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts=4, num_experts_per_tok=2))
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           num_local_experts=MODELS[kind], num_experts_per_tok=2, output_router_logits=True,
                           router_aux_loss_coef=0.1, attn_implementation="sdpa")
    return MixtralForCausalLM(config)


def loss_of(model, kind, x):
    if kind == "gpt":
        return model(x[:, :-1], x[:, 1:])
    if kind.endswith("padded"):  # the last two tokens of each row are padding: out of the loss and the routing's
        mask = torch.ones_like(x)
        mask[:, -2:] = 0
        return model(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100)).loss
    return model(input_ids=x, labels=x).loss


def logits_of(model, kind, x):
    return model(x) if kind == "gpt" else model(input_ids=x).logits


def model_parity(kind, ep_size, steps=3, strategy="ddp", rows=2, length=8, must_starve=False):
    """[failures] of expert parallelism (over `strategy`) against
    single-process torch on the world's whole batch: this rank's logits, the
    loss with its auxiliary terms (the mean over the ranks of each rank's
    loss, as the whole batch's), every parameter after `steps` AdamW steps.
    must_starve: fail unless this rank routes no token to some expert."""
    from tiny_zero.experts import data_parallel
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build(kind)
    reference = copy.deepcopy(module)
    wrapper, adamw = data_parallel(strategy)
    model = wrapper(module, ep_size=ep_size)
    options = dict(lr=1e-2, betas=(0.9, 0.95), eps=1.0, weight_decay=0.1)  # eps=1: see DESIGN.md
    opt, ref_opt = adamw(model, **options), torch.optim.AdamW(reference.parameters(), **options)
    failures = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 256, (rows * world, length + 1), generator=g)
        mine = x[rank * rows:(rank + 1) * rows]
        if step == 0:
            failures += differences("logits", logits_of(model, kind, mine[:, :length]).detach(),
                                    logits_of(reference, kind, mine[:, :length]).detach())
        loss = loss_of(model, kind, mine)
        if must_starve:  # so few tokens that this rank sends some expert none
            failures += starved(model)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        ref_loss = loss_of(reference, kind, x)
        failures += differences(f"step {step} loss", mean / world, ref_loss.detach())
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return failures + parameters_differ(model, reference, f"after {steps} steps")


def starved(model):
    """[a line] if this rank routed a token to every expert in the last forward, in some MoE layer."""
    for layer in model.moe_layers:
        picks = torch.topk(layer.router_logits, layer.top_k, dim=-1).indices.reshape(-1)
        if torch.bincount(picks, minlength=layer.num_experts).min() > 0:
            return ["every expert got a token from this rank: the starved case did not happen"]
    return []


def refused(kind, ep_size):
    """The error for experts that do not split over ep_size ranks, or for a block with more than a router and experts."""
    from tiny_zero.experts import ExpertParallel
    try:
        ExpertParallel(build(kind), ep_size=ep_size)
    except ValueError as e:
        return str(e)
    return f"no error: {kind} over {ep_size}"


def accumulate_and_clip(kind, ep_size, strategy="ddp", rows=2, length=8):
    """[failures] of three micro-batches (the first under no_sync), a clip
    that clips (the norm, the experts' grads in it) and a step, against
    torch's on the whole batches."""
    from tiny_zero.experts import data_parallel
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build(kind)
    reference = copy.deepcopy(module)
    wrapper, adamw = data_parallel(strategy)
    model = wrapper(module, ep_size=ep_size)
    options = dict(lr=1e-2, eps=1.0, weight_decay=0.1)
    opt, ref_opt = adamw(model, **options), torch.optim.AdamW(reference.parameters(), **options)
    batches = [torch.randint(0, 256, (rows * world, length + 1), generator=torch.Generator().manual_seed(10 + i))
               for i in range(3)]
    with model.no_sync():
        loss_of(model, kind, batches[0][rank * rows:(rank + 1) * rows]).backward()
    for x in batches[1:]:  # two averaging backwards, no zero_grad between: the averages add up
        loss_of(model, kind, x[rank * rows:(rank + 1) * rows]).backward()
    for x in batches:
        loss_of(reference, kind, x).backward()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    failures = differences("norm", model.clip_grad_norm_(0.05), want)
    failures += [] if want > 0.05 else [f"the norm {want:.3g} is under the clip: nothing was clipped"]
    opt.step()
    ref_opt.step()
    return failures + parameters_differ(model, reference, "after the step")


def estimate_holds(kind, ep_size, rows=2, length=8):
    """[failures]: tiny_zero.measure.estimate's expert memory a rank holds
    (expert_state) and all-to-all elements of one step (experts_comm_per_step,
    the ranks' mean), against what the wrapper holds and comm.stats counts."""
    from tiny_zero import comm
    from tiny_zero.experts import ExpertParallel, ExpertParallelAdamW
    from tiny_zero.measure import estimate
    module = build(kind)
    whole = estimate.expert_state(module, 1)
    tokens = length if kind == "gpt" else length + 1  # loss_of: the GPT's inputs are x[:, :-1], Mixtral's x
    expected_held = estimate.expert_state(module, ep_size)
    expected_sent = estimate.experts_comm_per_step(module, rows, tokens)["all_to_all"]
    model = ExpertParallel(module, ep_size=ep_size)
    opt = ExpertParallelAdamW(model, lr=1e-3)
    x = torch.randint(0, 256, (rows, length + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    before = comm.stats.elements["all_to_all"]
    loss_of(model, kind, x).backward()
    sent = torch.tensor(float(comm.stats.elements["all_to_all"] - before))
    opt.step()
    dist.all_reduce(sent)
    held = 4 * sum(p.numel() for p in model.expert_params()) + 4 * sum(
        t.numel() for s in opt.expert_adamw.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    held += 4 * sum(p.grad.numel() for p in model.expert_params())
    failures = [] if held == expected_held else [f"experts held: {held} bytes, estimate {expected_held}"]
    failures += [] if expected_held * ep_size == whole else [f"not 1/{ep_size} of {whole}: {expected_held}"]
    mean = sent.item() / dist.get_world_size()
    failures += [] if mean == expected_sent else [f"all_to_all elements: {mean}, estimate {expected_sent}"]
    return failures


def resumed_equal(kind, model, opt, x, frozen):
    """[failures]: a fresh model and optimizer loaded from this rank's
    state_dicts take the next step as the trained ones do (the experts'
    AdamW state is in the optimizer's state_dict)."""
    from tiny_zero.experts import ExpertParallel, ExpertParallelAdamW
    module = build(kind)
    module.get_parameter(frozen).requires_grad_(False)
    fresh = ExpertParallel(module)
    fresh.load_state_dict(model.state_dict())
    fresh_opt = ExpertParallelAdamW(fresh, lr=1e-2, weight_decay=0.1)
    fresh_opt.load_state_dict(opt.state_dict())
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.zero_grad()
        loss_of(m, kind, x).backward()
        o.step()
    want, got = model.full_state_dict(), fresh.full_state_dict()
    return [f"{name} differs after a resumed step" for name in want if not torch.equal(want[name], got[name])]


def state_dict_round_trip(kind):
    """[failures]: a trained model's state_dict() (and its full_state_dict(),
    the module's keys) loaded into a fresh wrapper gives the same values; a
    frozen expert tensor is never stepped; tiny_zero.checkpoint.save refuses;
    a model and optimizer resumed from their state_dicts step as the trained."""
    from tiny_zero.experts import ExpertParallel, ExpertParallelAdamW
    module = build(kind)
    frozen = next(name for name, _ in module.named_parameters() if name.endswith(("down_proj", "experts.c_proj")))
    module.get_parameter(frozen).requires_grad_(False)
    before = module.get_parameter(frozen).detach().clone()
    model = ExpertParallel(module)
    opt = ExpertParallelAdamW(model, lr=1e-2, weight_decay=0.1)
    x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss_of(model, kind, x).backward()
    opt.step()
    saved = model.full_state_dict()
    failures = [] if torch.equal(saved[frozen], before) else [f"{frozen} (frozen) was stepped"]
    import tempfile

    import tiny_zero
    try:
        tiny_zero.checkpoint.save(f"{tempfile.gettempdir()}/tiny_zero_experts_refused", model, opt, step=1)
        failures.append("tiny_zero.checkpoint.save did not refuse an expert-parallel model")
    except RuntimeError as e:  # the checkpoint's error, the same on every rank
        failures += [] if "does not save expert-parallel models" in str(e) else [str(e)]
    for state in (model.state_dict(), saved):
        fresh = ExpertParallel(build(kind))
        fresh.load_state_dict(state)
        loaded = fresh.full_state_dict()
        failures += [f"{name} not loaded" for name in saved if not torch.equal(saved[name], loaded[name])]
    return failures + resumed_equal(kind, model, opt, x, frozen)
