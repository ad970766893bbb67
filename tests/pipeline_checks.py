"""Worker functions for tests/test_pipeline.py (run on every rank).

The model is the example GPT as an nn.Sequential (example/model.py:
GPTSequential), small: embeddings whose wte is tied to the head, two
attention blocks, the head; four children. Besides: stages that pass tuples
and dicts of tensors (several_tensors_model), a stage without parameters,
and a Hugging Face Llama cut by pipeline_stages. Every check compares with
plain torch on one process (nn layers, torch.optim.AdamW, the concatenated
batch) and returns a list of failures, or measurements.
"""
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

import tiny_zero
from example.model import GPTConfig, GPTSequential, loss_fn
from tiny_zero import agreements, checkpoint, comm
from tiny_zero.measure.memory import TensorMemory
from tiny_zero.pipeline import Pipeline, PipelineAdamW
from tiny_zero.precision import LossScaler
from harness import module_state_dict_failures

CONFIG = GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=8)
ROWS, SEQ = 4, 8  # rows per replica per step
LR, WD, STEPS = 1e-2, 0.1, 5
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-4


def batch(step, replicas=1):
    """The global batch of a step: `replicas` × ROWS rows."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CONFIG.vocab_size, (replicas * ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def mine(pipe, tensors):
    """This replica's rows."""
    return [t[pipe.replica * ROWS:(pipe.replica + 1) * ROWS] for t in tensors]


def build(schedule, stages=None, microbatches=4, device="meta", **options):
    """A pipeline of the model built on `device` (meta: each rank materialises its stage only)."""
    with torch.device(device):
        seq = GPTSequential(CONFIG)
    pipe = Pipeline(seq, loss_fn, microbatches=microbatches, schedule=schedule, stages=stages,
                    bucket_bytes=400, **options)  # several buckets per stage
    return pipe, PipelineAdamW(pipe, lr=LR, weight_decay=WD)


def compare(where, pipe, ref, failures, atol=PARAM_ATOL):
    state = pipe.full_state_dict()
    for key, want in ref.state_dict().items():
        if not torch.allclose(state[key], want, rtol=0, atol=atol):
            failures.append(f"{where}: {key} differs by {(state[key] - want).abs().max().item():.2e}")


def close(got, want, rtol=LOSS_RTOL):
    return abs(got - want) <= rtol * abs(want)


# ---------------------------------------------------------------- parity

def parity(schedules, stages=None, clip=None):
    """Each schedule against torch: the loss and the clip norm of each of
    STEPS steps, then every parameter, and eval_step's loss. Returns
    (failures, the largest parameter difference)."""
    failures, largest = [], 0.0
    for schedule in schedules:
        pipe, opt = build(schedule, stages)
        where = f"{schedule} S={pipe.stages} R={pipe.replicas}"
        ref = GPTSequential(CONFIG)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
        for step in range(STEPS):
            x, y = batch(step, pipe.replicas)
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item() if clip else None
            ref_opt.step()
            ref_opt.zero_grad()
            loss = pipe.train_step(*mine(pipe, (x, y)))
            norm = pipe.clip_grad_norm_(clip).item() if clip else None
            opt.step()
            opt.zero_grad()
            if not close(loss, ref_loss.item()):
                failures.append(f"{where} step {step}: loss {loss} vs torch {ref_loss.item()}")
            if clip and not close(norm, ref_norm):
                failures.append(f"{where} step {step}: clip norm {norm} vs torch {ref_norm}")
        state = pipe.full_state_dict()
        largest = max([largest] + [(state[k] - v).abs().max().item() for k, v in ref.state_dict().items()])
        compare(f"{where} after {STEPS} steps", pipe, ref, failures)
        x, y = batch(99, pipe.replicas)
        with torch.no_grad():
            ref_loss = loss_fn(ref(x), y).item()
        if not close(pipe.eval_step(*mine(pipe, (x, y))), ref_loss):
            failures.append(f"{where}: eval_step's loss differs from torch's {ref_loss}")
    return failures, largest


def holds_its_stage_only():
    """Built on meta, a rank materialises the parameters of its stage only
    (the others point at one shared zero); the tied wte and head are one
    parameter in each stage that holds them, equal after steps."""
    pipe, opt = build("1f1b")
    failures = []
    held = {p for layer in pipe.layers for p in layer.parameters()}
    for name, p in pipe.module.named_parameters():
        allocated = p.untyped_storage().nbytes() > p.element_size()
        if allocated != (p in held):
            failures.append(f"stage {pipe.stage}: {name} is {'' if allocated else 'not '}materialised here")
    for step in range(2):
        pipe.train_step(*mine(pipe, batch(step, pipe.replicas)))
        opt.step()
        opt.zero_grad()
    wte, head = pipe.module[0].wte.weight, pipe.module[-1].lm_head.weight
    if wte is not head:
        failures.append("the tied head is not wte")
    values = [torch.zeros(wte.shape), torch.zeros(wte.shape)]
    for holder, stage in enumerate((0, pipe.stages - 1)):
        if pipe.stage == stage:
            values[holder] = wte.detach().float().cpu()
    for value in values:
        dist.all_reduce(value)
    if not torch.equal(values[0], values[1]):
        failures.append("the first and the last stage hold different values of the tied weight")
    return failures


# ---------------------------------------------------------------- torch's training loop

class Frozen(nn.Module):
    """A child whose Linear is frozen: never stepped, never sent."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(CONFIG.n_embd, CONFIG.n_embd)
        self.fc.requires_grad_(False)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def loop_model():
    torch.manual_seed(0)
    seq = GPTSequential(CONFIG)
    return nn.Sequential(seq[0], Frozen(), seq[1], seq[2], seq[3])


def groups(module):
    """No decay on 1-D parameters, half the lr for the embeddings (by name)."""
    named = dict(module.named_parameters())
    return [{"params": [p for n, p in named.items() if p.dim() >= 2 and not n.startswith("0.")]},
            {"params": [p for p in named.values() if p.dim() < 2], "weight_decay": 0.0},
            {"params": ["0.wte.weight", "0.wpe.weight"], "lr": LR / 2}]


def training_loop(schedule, stages, loop):
    """A frozen layer, param groups, a LambdaLR warm-up, eps=1 (the update is
    about lr·g: a wrong average shows), and the loop's way of accumulating:
    plain (clearing with module.zero_grad() on odd steps); two train_steps per step; no_sync on the first of two; no
    zero_grad (the grads carry into the next step). Every loss and parameter
    as torch's; the frozen layer bit-unchanged and never sent."""
    ref = loop_model()
    ref_groups = groups(ref)
    ref_groups[2]["params"] = [ref[0].wte.weight, ref[0].wpe.weight]
    ref_opt = torch.optim.AdamW(ref_groups, lr=LR, eps=1.0, weight_decay=WD)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: min(1.0, (s + 1) / 3))
    module = loop_model()
    pipe = Pipeline(module, loss_fn, microbatches=2, schedule=schedule, stages=stages, bucket_bytes=400)
    opt = PipelineAdamW(pipe, groups(module), lr=LR, eps=1.0, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    frozen = {k: v.clone() for k, v in ref.state_dict().items() if k.startswith("1.")}
    failures, where = [], f"{schedule} S={pipe.stages} R={pipe.replicas} {loop}"
    passes = 2 if loop in ("two", "no_sync") else 1
    for step in range(4):
        ref_loss = loss = 0.0
        for micro in range(passes):
            x, y = batch(10 * step + micro, pipe.replicas)
            part = loss_fn(ref(x), y)
            part.backward()  # grads add up over the passes, as over train_steps
            ref_loss += part.item() / passes
            comm.stats.reset()
            with pipe.no_sync() if loop == "no_sync" and micro == 0 else nullcontext():
                loss += pipe.train_step(*mine(pipe, (x, y))) / passes
            sent = comm.stats.elements["all_reduce"] - 1  # the loss
            quiet = loop == "no_sync" and micro == 0
            if sent > (0 if quiet else pipe.flat_grads.numel()):
                failures.append(f"{where} step {step}: {sent} grad elements sent, more than "
                                f"{'none, inside no_sync()' if quiet else 'the stage has'}")
        for o, s, m in ((ref_opt, ref_sched, ref), (opt, sched, module)):
            o.step()
            s.step()
            if loop == "plain" and step % 2:
                m.zero_grad()  # p.grad = None outside the optimizer: the grads go as well
            elif loop != "no_zero_grad":
                o.zero_grad()
        if not close(loss, ref_loss):
            failures.append(f"{where} step {step}: loss {loss} vs torch {ref_loss}")
        compare(f"{where} step {step}", pipe, ref, failures, atol=1e-5)
        state = pipe.full_state_dict()
        failures += [f"{where}: frozen {k} moved" for k, v in frozen.items() if not torch.equal(state[k], v)]
    if any(p in pipe.buckets.of for p in pipe.module[1].parameters()):
        failures.append(f"{where}: a frozen parameter is in a gradient bucket")
    return failures


def training_loops(schedule, stages=None):
    return [f for loop in ("plain", "two", "no_sync", "no_zero_grad") for f in training_loop(schedule, stages, loop)]


def grads_and_state_dicts():
    """p.grad is set on the stage that steps a parameter (None elsewhere,
    the tied head's copy included) and is torch's grad; state_dict() is
    full and keyed as torch DDP's; it loads into a fresh pipeline and into
    plain torch (and model.module's, harness.py)."""
    pipe, opt = build("1f1b")
    ref = GPTSequential(CONFIG)
    x, y = batch(0, pipe.replicas)
    loss_fn(ref(x), y).backward()
    pipe.train_step(*mine(pipe, (x, y)))
    failures = []
    owner = {p: pipe.holders[p][0] for p in pipe.holders}
    for (name, p), ref_p in zip(pipe.module.named_parameters(), ref.parameters()):
        if owner[p] != pipe.stage:
            if p.grad is not None:
                failures.append(f"stage {pipe.stage}: {name} has a p.grad, but another stage steps it")
        elif p.grad is None or not torch.allclose(p.grad, ref_p.grad, rtol=1e-5, atol=1e-7):
            failures.append(f"stage {pipe.stage}: p.grad of {name} is not torch's")
    opt.step()
    state = pipe.state_dict()
    fresh, _ = build("gpipe")
    fresh.load_state_dict(state)
    if any(not torch.equal(v, state["module." + k]) for k, v in fresh.full_state_dict().items()):
        failures.append("a fresh pipeline did not get every value from load_state_dict")
    plain = GPTSequential(CONFIG, seed=1)
    plain.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    if any(not torch.equal(v, state["module." + k]) for k, v in plain.state_dict().items()):
        failures.append("plain torch did not get the values")
    failures += module_state_dict_failures(build("gpipe")[0], {k.removeprefix("module."): v for k, v in state.items()})
    try:
        pipe(x)
        failures.append("calling the pipeline did not raise")
    except RuntimeError as e:
        if "train_step" not in str(e):
            failures.append(f"unclear error: {e}")
    return failures


# ---------------------------------------------------------------- memory

def live_microbatches(schedule, stages=None, microbatches=4):
    """Stage by stage: the activations autograd holds after each action,
    counted by TensorMemory, in micro-batches' worth (the bytes after the
    first forward), at their most; and the step's peak live bytes."""
    pipe, opt = build(schedule, stages, microbatches)
    x, y = (t[:microbatches] for t in batch(0, 2))  # a row per micro-batch
    pipe.train_step(x, y)  # the first step allocates the grads
    after = []
    with TensorMemory() as memory:
        for step in ("forward_step", "backward_step"):
            def recorded(m, run=getattr(pipe, step)):
                run(m)
                after.append(memory.breakdown()["activations"])
            setattr(pipe, step, recorded)
        memory.reset_peak()
        pipe.train_step(x, y)
    return {"stage": pipe.stage, "live": max(after) / after[0], "peak": memory.peak}


# ---------------------------------------------------------------- precision, checkpoints

def mixed_precision():
    """bf16 and fp16 (loss scaled) follow fp32 within 5e-2, clipped; the
    state dict holds the fp32 masters; nothing is skipped."""
    failures, runs = [], {}
    for mp, options in ((None, {}), ("bf16", {}), ("fp16", {"loss_scaler": LossScaler(init_scale=2**8)})):
        pipe, opt = build("1f1b", mixed_precision=mp, **options)
        losses = []
        for step in range(4):
            losses.append(pipe.train_step(*mine(pipe, batch(step, pipe.replicas))))
            losses.append(pipe.clip_grad_norm_(0.5).item())
            opt.step()
            opt.zero_grad()
        runs[mp] = losses
        state = pipe.full_state_dict()
        if any(v.dtype != torch.float32 for v in state.values()):
            failures.append(f"{mp}: full_state_dict is not fp32")
        if opt.skipped_steps:
            failures.append(f"{mp}: {opt.skipped_steps} steps skipped")
    for mp in ("bf16", "fp16"):
        failures += [f"{mp}: loss or norm {got} vs fp32 {want}" for got, want in zip(runs[mp], runs[None])
                     if not close(got, want, rtol=5e-2)]
    return failures


def save_and_load(root, saves, loads):
    """saves: [(name, strategy, stages)] to train 2 steps, save under
    root/name, and note the values then and after one more step; loads:
    [(name, strategy, stages)] to load root/name: every value as saved, and
    one more step as the saving run's (optimizer state included)."""
    failures = []
    for name, strategy, stages in saves:
        model, opt = make(strategy, stages)
        for step in range(2):
            train(model, opt, step)
        checkpoint.save(f"{root}/{name}", model, opt, step=2)
        saved = model.full_state_dict()
        train(model, opt, 2)
        after = model.full_state_dict()  # a collective: on every rank
        if dist.get_rank() == 0:
            torch.save({"saved": saved, "next": after}, f"{root}/{name}.pt")
        dist.barrier()
    for name, strategy, stages in loads:
        model, opt = make(strategy, stages)
        info = checkpoint.load(f"{root}/{name}", model, opt)
        want = torch.load(f"{root}/{name}.pt")
        where = f"{name} into {strategy}{f' S={stages}' if stages else ''} at world {dist.get_world_size()}"
        got = model.full_state_dict()
        failures += [f"{where}: {k} differs" for k, v in want["saved"].items() if not torch.equal(got[k], v)]
        train(model, opt, 2)
        compare(f"{where}, a step later", model, FullState(want["next"]), failures, atol=1e-5)
        if info["step"] != 2:
            failures.append(f"{where}: step {info['step']}")
    return failures


class FullState:
    """A saved full_state_dict, where compare() wants a module."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


def make(strategy, stages):
    if strategy == "pipeline":
        return build("1f1b", stages)
    torch.manual_seed(0)
    wrapper, adamw = tiny_zero.STRATEGIES[strategy]
    model = wrapper(GPTSequential(CONFIG))
    return model, adamw(model, lr=LR, weight_decay=WD)


def train(model, opt, step):
    """One step of the same global batch (24 rows) at every world size."""
    x, y = batch(step, 6)
    if isinstance(model, Pipeline):
        rows = 24 // model.replicas
        x, y = (t[model.replica * rows:(model.replica + 1) * rows] for t in (x, y))
        model.train_step(x, y)
    else:
        rows = 24 // model.world_size
        x, y = (t[model.rank * rows:(model.rank + 1) * rows] for t in (x, y))
        model.backward(loss_fn(model(x), y))
    opt.step()
    opt.zero_grad()


# ---------------------------------------------------------------- errors

COLLECTIVES = ("all_reduce", "all_gather_object", "broadcast", "new_group", "isend", "irecv", "batch_isend_irecv")


def errors():
    """Misuse raises a clear error on every rank before any collective:
    {case: the message, or what went wrong}."""
    world = dist.get_world_size()
    cases = {
        "not sequential": lambda: Pipeline(GPTSequential(CONFIG)[0], loss_fn),
        "fewer children": lambda: Pipeline(nn.Sequential(nn.Linear(2, 2)), loss_fn),
        "world not divisible": lambda: Pipeline(GPTSequential(CONFIG), loss_fn, stages=world + 1),
        "bad balance": lambda: Pipeline(GPTSequential(CONFIG), loss_fn, balance=[3, 2]),
        "unknown schedule": lambda: Pipeline(GPTSequential(CONFIG), loss_fn, schedule="zb"),
    }
    out = {case: attempt(make) for case, make in cases.items()}
    pipe, _ = build("1f1b", microbatches=4)
    x, y = batch(0)
    out["batch not divisible"] = attempt(lambda: pipe.train_step(x[:3], y[:3]))
    out["eval batch not divisible"] = attempt(lambda: pipe.eval_step(x[:2], y[:2]))
    return out


def attempt(action):
    """The error message of action(); FAILED: ... if it did not raise, or
    called a collective first (the agreements on the side channel aside)."""
    called = []
    saved = {name: getattr(dist, name) for name in COLLECTIVES}
    side = set(agreements._side_groups.values())

    def record(name, *args, **kwargs):
        if kwargs.get("group") not in side:
            called.append(name)
        return saved[name](*args, **kwargs)

    for name in COLLECTIVES:
        setattr(dist, name, lambda *args, _name=name, **kwargs: record(_name, *args, **kwargs))
    try:
        action()
        return "FAILED: no error"
    except (TypeError, ValueError, RuntimeError) as e:
        return f"FAILED: {called} before the error: {e}" if called else str(e)
    finally:
        for name, function in saved.items():
            setattr(dist, name, function)


# ---------------------------------------------------------------- stages that pass several tensors

V, C = 11, 6  # vocabulary, width


class Embed(nn.Module):
    """A dict in; a tuple out: the hidden states, the ids (int64), and a float
    that needs no grad (sent forward only)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)

    def forward(self, x):
        ids = x["ids"]
        return self.emb(ids), ids, (ids % 3).float()


class Mix(nn.Module):
    """A tuple in; a dict out: a bool, a None, and the input hidden states
    passed on unchanged beside the new ones (both get grads back)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)

    def forward(self, inputs):
        h, ids, weight = inputs
        return {"h": torch.tanh(self.fc(h)) * weight.unsqueeze(-1), "residual": h, "ids": ids,
                "odd": ids % 2 == 1, "nothing": None}


class Swap(nn.Module):
    """No parameters; its output is a transpose, not contiguous."""

    def forward(self, d):
        return {**d, "h": d["h"].transpose(1, 2)}


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.fc = nn.Linear(C, V)

    def forward(self, d):
        h = d["h"].transpose(1, 2) + d["residual"] + self.emb(d["ids"]) * d["odd"].unsqueeze(-1)
        return self.fc(h)


def several_tensors_model():
    torch.manual_seed(0)
    return nn.Sequential(Embed(), Mix(), Swap(), Head())


def token_loss(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def token_batch(step, replicas):
    """The global batch of a step; its length changes from step to step (6, 4, 6, 4, ...)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, V, (replicas * ROWS, (6, 4)[step % 2] + 1), generator=g)
    return {"ids": tokens[:, :-1]}, tokens[:, 1:]


def several_tensors(runs):
    """runs: [(schedule, stages, balance)]. Stages that pass a tuple and a dict
    (ints, a bool, None, a float forward only, a tensor passed on) and a stage
    without parameters whose output is a transpose, against torch: the loss of
    every step and every parameter after 4 AdamW steps (eps=1). The sequence
    length changes every step: each stage sends its layout once per shape,
    then only the tensors (counted)."""
    failures = []
    for schedule, stages, balance in runs:
        pipe = Pipeline(several_tensors_model(), token_loss, microbatches=2, schedule=schedule, stages=stages,
                        balance=balance)
        opt = PipelineAdamW(pipe, lr=LR, eps=1.0, weight_decay=WD)
        ref = several_tensors_model()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=1.0, weight_decay=WD)
        where = f"{schedule} S={pipe.stages} R={pipe.replicas} balance {balance}"
        for step in range(4):
            x, y = token_batch(step, pipe.replicas)
            ref_loss = token_loss(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            comm.stats.reset()
            rows = slice(pipe.replica * ROWS, (pipe.replica + 1) * ROWS)
            loss = pipe.train_step({"ids": x["ids"][rows]}, y[rows])
            sends = comm.stats.calls["send"]
            opt.step()
            opt.zero_grad()
            if not close(loss, ref_loss.item()):
                failures.append(f"{where} step {step}: loss {loss} vs torch {ref_loss.item()}")
            expected = messages_per_step(pipe) + (2 if step < 2 and not pipe.last else 0)  # a layout: size, bytes
            expected += 1 if step < 2 and not pipe.first else 0  # which received tensors were read
            if sends != expected:
                failures.append(f"{where} step {step}: stage {pipe.stage} sent {sends} messages, not {expected}")
        compare(where, pipe, ref, failures, atol=1e-5)
    return failures


def messages_per_step(pipe):
    """The tensors a stage of several_tensors_model sends in a step, once it
    knows the layouts: each micro-batch's non-empty output tensors forward,
    and the grads of the received tensors that carry one backward."""
    forward = {Embed: 3, Mix: 4, Swap: 4}[type(pipe.layers[-1])] if not pipe.last else 0  # None is not sent
    backward = {Embed: 0, Mix: 1, Swap: 2, Head: 2}[type(pipe.layers[0])]
    return pipe.microbatches * (forward + backward)


def stage_without_parameters(root):
    """The default balance of [Linear, ReLU, Identity] on 2 stages is [1, 2]:
    the last stage holds no parameter. It trains as torch (GPipe and 1F1B),
    and its state dicts and checkpoints work."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Identity())

    def mse(out, y):
        return ((out - y) ** 2).mean()

    failures = []
    for schedule in ("gpipe", "1f1b"):
        pipe = Pipeline(model(), mse, microbatches=2, schedule=schedule, stages=2)
        opt = PipelineAdamW(pipe, lr=LR, weight_decay=WD)
        ref = model()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4 * pipe.replicas, 8, generator=g), torch.randn(4 * pipe.replicas, 8, generator=g)
            mse(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            rows = slice(pipe.replica * 4, (pipe.replica + 1) * 4)
            pipe.train_step(x[rows], y[rows])
            opt.step()
            opt.zero_grad()
        compare(f"{schedule}, a stage without parameters", pipe, ref, failures, atol=1e-6)
        state = pipe.state_dict()
        if sorted(state) != sorted("module." + k for k in ref.state_dict()):
            failures.append(f"state_dict keys {sorted(state)}")
        fresh = Pipeline(model(), mse, microbatches=2, schedule=schedule, stages=2)
        fresh.load_state_dict(state)
        trained = FullState(pipe.full_state_dict())
        compare(f"{schedule}, load_state_dict", fresh, trained, failures, atol=0)
        path = f"{root}/empty-{schedule}-{dist.get_world_size()}"
        checkpoint.save(path, pipe, opt, step=3)
        loaded = Pipeline(model(), mse, microbatches=2, schedule=schedule, stages=2)
        checkpoint.load(path, loaded, PipelineAdamW(loaded, lr=LR, weight_decay=WD))
        compare(f"{schedule}, a checkpoint", loaded, trained, failures, atol=0)
    return failures


# ---------------------------------------------------------------- a Hugging Face decoder, cut by layers

def tiny_llama(tied):
    """Grouped-query attention (4 heads, 2 of keys and values), rotary, 4 layers."""
    import transformers
    config = transformers.LlamaConfig(vocab_size=V * 3, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def llama_batch(step, replicas, masked):
    """input_ids (with an attention mask that leaves out a token of the first row, if masked) and labels."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, V * 3, (replicas * ROWS, 7), generator=g)
    x = {"input_ids": tokens[:, :-1]}
    if masked:
        x["attention_mask"] = torch.ones_like(x["input_ids"])
        x["attention_mask"][0, 2] = 0
    return x, tokens[:, 1:]


def hf_llama(stages):
    """pipeline_stages(llama, 2) on `stages` stages (× replicas): GPipe and
    1F1B, a tied and an untied head, against the model in torch: the loss of
    each of 4 AdamW steps (eps=1) and every parameter after them. The tied
    run passes an attention mask along the stages."""
    from tiny_zero.pipeline.stages import pipeline_stages
    failures = []
    for schedule in ("gpipe", "1f1b"):
        for tied in (True, False):
            model = tiny_llama(tied)
            pipe = Pipeline(pipeline_stages(model, stages), token_loss, microbatches=2, schedule=schedule,
                            stages=stages)
            opt = PipelineAdamW(pipe, lr=LR, eps=1.0, weight_decay=WD)
            ref = tiny_llama(tied)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=1.0, weight_decay=WD)
            where = f"llama {'tied' if tied else 'untied'} {schedule} S={pipe.stages} R={pipe.replicas}"
            for step in range(4):
                x, y = llama_batch(step, pipe.replicas, masked=tied)
                ref_loss = token_loss(ref(**x).logits, y)
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                rows = slice(pipe.replica * ROWS, (pipe.replica + 1) * ROWS)
                loss = pipe.train_step({k: v[rows] for k, v in x.items()}, y[rows])
                opt.step()
                opt.zero_grad()
                if not close(loss, ref_loss.item()):
                    failures.append(f"{where} step {step}: loss {loss} vs torch {ref_loss.item()}")
            state = {k.split(".", 1)[1]: v for k, v in pipe.full_state_dict().items()}  # "1.model.norm.weight"
            for key, want in ref.state_dict().items():
                got = state[key]
                if not torch.allclose(got, want, rtol=LOSS_RTOL, atol=1e-6):
                    failures.append(f"{where}: {key} differs by {(got - want).abs().max().item():.2e}")
    return failures
