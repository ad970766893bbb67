"""Worker functions for tests/test_semantics.py: torch's training-loop habits,
on every strategy, against single-process torch (nn layers, torch.optim.AdamW,
the concatenated batch). Each returns a list of failures."""
import copy
from contextlib import nullcontext
from itertools import groupby

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

import tiny_zero
from tiny_zero import comm

STRATEGIES = list(tiny_zero.STRATEGIES)
VOCAB, WIDTH, HIDDEN, SEQ, PER_RANK = 13, 8, 6, 5, 2
LR, WD, STEPS = 1e-2, 0.1, 5
RTOL, ATOL = 1e-5, 1e-6


class LoopNet(nn.Module):
    """A tied embedding and head, a frozen layer, a layer never used, and a
    layer used only when `use_sometimes` is set (on alternate steps)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH, bias=False)
        self.sometimes = nn.Linear(WIDTH, WIDTH)
        self.unused = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.frozen.requires_grad_(False)
        self.use_sometimes = True

    def forward(self, idx, targets):
        h = self.emb(idx)
        h = h + torch.tanh(self.frozen(self.ln(h)))
        h = h + self.fc2(torch.tanh(self.fc1(h)))
        if self.use_sometimes:
            h = h + torch.tanh(self.sometimes(h))
        return F.cross_entropy(self.head(h).view(-1, VOCAB), targets.reshape(-1))


def global_batch(step, micro=0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, VOCAB, (dist.get_world_size() * PER_RANK, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def my_rows(tensors):
    rank = dist.get_rank()
    return [t[rank * PER_RANK:(rank + 1) * PER_RANK] for t in tensors]


def groups_of(module, by_name):
    """No decay on 1-D parameters, half the lr for the embedding: one group
    given by names, the others by parameters (as torch users write them)."""
    named = dict(module.named_parameters())
    decay = [p for n, p in named.items() if p.dim() >= 2 and n != "emb.weight"]
    no_decay = [p for p in named.values() if p.dim() < 2]
    emb = ["emb.weight"] if by_name else [named["emb.weight"]]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0},
            {"params": emb, "lr": LR / 2}]


def warmup(step):
    return min(1.0, (step + 1) / 3)


LOOPS = {  # name: (backward passes per step, no_sync on all but the last, zero_grad after every step)
    "plain": (1, False, True),
    "two_backwards": (2, False, True),  # torch DDP: each backward averages, the grads add up
    "no_sync": (2, True, True),
    "no_zero_grad": (1, False, False),  # the grads of one step carry into the next
}


def make_torch(groups=True):
    torch.manual_seed(0)
    model = LoopNet()
    params = groups_of(model, by_name=False) if groups else model.parameters()
    opt = torch.optim.AdamW(params, lr=LR, eps=1.0, weight_decay=WD)
    return model, opt


def make_tiny(name, groups=True, **options):
    torch.manual_seed(0)
    module = LoopNet()
    wrapper_cls, opt_cls = tiny_zero.STRATEGIES[name]
    extra = {} if name == "fsdp" else {"bucket_bytes": 200}  # many small buckets
    model = wrapper_cls(module, **extra, **options)
    params = groups_of(module, by_name=True) if groups else None
    return model, opt_cls(model, params, lr=LR, eps=1.0, weight_decay=WD)


def run_loop(model, opt, loop, step, distributed, sent=None):
    """One step's forward and backward passes; `sent`, a list: gets the grad
    elements each backward pass sent (a wrapped model's)."""
    backwards, use_no_sync, _ = LOOPS[loop]
    module = model.module if distributed else model
    module.use_sometimes = step % 2 == 0
    total = 0.0
    for micro in range(backwards):
        batch = global_batch(step, micro)
        x, y = my_rows(batch) if distributed else batch
        quiet = use_no_sync and micro < backwards - 1 and distributed
        before = grad_elements_sent()
        with model.no_sync() if quiet else nullcontext():
            loss = model(x, y) / backwards
            loss.backward()
        if sent is not None:
            sent.append(grad_elements_sent() - before)
        total += loss.item()
    return total


def grad_elements_sent():
    """The elements of every grad reduction tiny_zero sent so far."""
    return sum(n for kind, n in comm.stats.elements.items() if kind in ("all_reduce", "reduce_scatter", "reduce"))


def refused(call, expected, what, error=RuntimeError):
    """[] if call() raises `error` with `expected` in its message, else the failure."""
    try:
        call()
    except error as e:
        return [] if expected in str(e) else [f"{what}: unclear error {str(e)[:200]}"]
    return [f"{what} went on without an error"]


def differs_from_torch(where, model, ref):
    """A failure for each parameter of `model` (full values) not within
    tolerance of the torch model `ref`'s."""
    state = model.full_state_dict()
    return [f"{where}: {key} differs by {(state[key] - want).abs().max():.2e}"
            for key, want in ref.state_dict().items() if not torch.allclose(state[key], want, rtol=RTOL, atol=ATOL)]


def training_loop(name, loop):
    """Frozen, never-used and alternate-step layers, param groups, a LambdaLR
    warm-up, and the loop's way of accumulating: every step's loss and every
    parameter equal torch's; frozen and never-used parameters are bit-identical
    to their initial values; no frozen parameter is ever sent."""
    ref, ref_opt = make_torch()
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, warmup)
    model, opt = make_tiny(name)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    zero_grad = LOOPS[loop][2]
    failures, where = [], f"{name}/{loop} world {dist.get_world_size()}"
    frozen = {p for p in model.module.parameters() if not p.requires_grad}
    if any(p in model.buckets.of for p in frozen):
        failures.append(f"{where}: a frozen parameter is in a gradient bucket")
    for step in range(STEPS):
        ref_loss = run_loop(ref, ref_opt, loop, step, distributed=False)
        ref_opt.step()
        ref_sched.step()
        sent = []  # per backward pass
        loss = torch.tensor(run_loop(model, opt, loop, step, distributed=True, sent=sent))
        opt.step()
        sched.step()
        if zero_grad:
            ref_opt.zero_grad()
            opt.zero_grad()
        dist.all_reduce(loss)
        loss = loss.item() / dist.get_world_size()
        if abs(loss - ref_loss) > ATOL + RTOL * abs(ref_loss):
            failures.append(f"{where} step {step}: loss {loss} vs torch {ref_loss}")
        trainable = sum(b.numel for b in model.buckets)
        quiet = len(sent) - 1 if LOOPS[loop][1] else 0  # the backward passes inside no_sync(): they send nothing
        if any(sent[:quiet]):
            failures.append(f"{where} step {step}: backward passes inside no_sync() sent {sent[:quiet]} grad elements")
        if any(n > trainable for n in sent[quiet:]):
            failures.append(f"{where} step {step}: a backward pass sent more grad elements than the trainable "
                            f"ones ({sent[quiet:]} of {trainable})")
        failures += differs_from_torch(f"{where} step {step}", model, ref)
        state = model.full_state_dict()
        failures += [f"{where} step {step}: {key} moved (frozen or never used)" for key in ref.state_dict()
                     if key.startswith(("frozen.", "unused.")) and not torch.equal(state[key], initial[key])]
    return failures


def training_loops(names, loops):
    return [f for loop in loops for name in names for f in training_loop(name, loop)]


def add_param_group_and_set_to_none_false(name):
    """A group added after some steps is stepped from then on, as in torch;
    zero_grad(set_to_none=False) keeps zero grads, so a layer unused in the
    next step is still stepped (momentum and decay), as in torch."""
    failures, where = [], f"{name} world {dist.get_world_size()}"

    def first_groups(module):
        return [p for n, p in module.named_parameters() if not n.startswith("sometimes.")]

    ref, _ = make_torch(groups=False)
    ref_opt = torch.optim.AdamW(first_groups(ref), lr=LR, eps=1.0, weight_decay=WD)
    model, _ = make_tiny(name, groups=False)
    opt = tiny_zero.STRATEGIES[name][1](model, first_groups(model.module), lr=LR, eps=1.0, weight_decay=WD)
    for step in range(4):
        for m, o, dist_ in ((ref, ref_opt, False), (model, opt, True)):
            if step == 2:
                o.add_param_group({"params": list(getattr(m, "module", m).sometimes.parameters()), "lr": 2 * LR})
            run_loop(m, o, "plain", step, dist_)
            o.step()
            o.zero_grad(set_to_none=False)
        failures += differs_from_torch(f"{where} step {step}", model, ref)
    return failures


def state_dicts(name):
    """model.state_dict() is full, keyed as torch DDP's, on every rank; it
    loads into a fresh wrapper of the same strategy and into plain torch. The
    optimizer's state_dict holds each parameter's step count by its name
    (opt.state[p] is empty) and the moments by shard; it loads back where it
    was made, and refuses another rank's (but for ddp, whose state is the
    same on every rank)."""
    failures, where = [], f"{name} world {dist.get_world_size()}"
    model, opt = make_tiny(name)
    for step in range(2):
        run_loop(model, opt, "plain", step, True)
        opt.step()
        opt.zero_grad()
    sd = model.state_dict()
    full = model.full_state_dict()
    if list(sd) != ["module." + k for k in full]:
        failures.append(f"{where}: state_dict keys {list(sd)[:3]}... are not module.<key>")
    if any(not torch.equal(sd["module." + k], v) or v.numel() == 0 for k, v in full.items()):
        failures.append(f"{where}: state_dict values are not the full values")
    fresh, fresh_opt = make_tiny(name)
    torch.manual_seed(1)
    result = fresh.load_state_dict(sd)
    if result.missing_keys or result.unexpected_keys:
        failures.append(f"{where}: load_state_dict reported {result}")
    if any(not torch.equal(v, full[k]) for k, v in fresh.full_state_dict().items()):
        failures.append(f"{where}: a fresh {name} did not get every value from load_state_dict")
    plain = LoopNet()
    consume_prefix_in_state_dict_if_present(sd, "module.")
    plain.load_state_dict(sd)
    if any(not torch.equal(v, full[k]) for k, v in plain.state_dict().items()):
        failures.append(f"{where}: plain torch did not get the values")
    # the optimizer: the step counts by parameter name (those stepped every step: 2), the moments by shard
    counts = {k: float(v["step"]) for k, v in opt.state_dict()["state"].items() if "step" in v}
    every_step = [k for k in ("emb.weight", "fc1.weight", "fc2.weight") if k in counts]
    if not every_step or any(counts[k] != 2 for k in every_step) or opt.state[model.module.fc1.weight]:
        failures.append(f"{where}: opt.state_dict()['state'] has step counts {counts}, and "
                        f"opt.state[fc1.weight] {dict(opt.state[model.module.fc1.weight])}")
    if model.shards and not any("exp_avg" in opt.state[shard] for shard in model.shards):
        failures.append(f"{where}: no opt.state[model.shards[i]] holds an exp_avg")
    # its own state loads back and training goes on identically
    fresh_opt.load_state_dict(opt.state_dict())
    for m, o in ((model, opt), (fresh, fresh_opt)):
        run_loop(m, o, "plain", 2, True)
        o.step()
        o.zero_grad()
    if any(not torch.equal(v, model.full_state_dict()[k]) for k, v in fresh.full_state_dict().items()):
        failures.append(f"{where}: training after load_state_dict of model and optimizer differs")
    saved = [opt.state_dict()]
    dist.broadcast_object_list(saved, src=0)  # "rank 0 saves, every rank loads"
    try:
        fresh_opt.load_state_dict(saved[0])
        if dist.get_rank() != 0 and name != "ddp":
            failures.append(f"{where}: rank {dist.get_rank()} loaded rank 0's optimizer state without an error")
    except ValueError as e:
        if name == "ddp" or "saved by rank 0" not in str(e):
            failures.append(f"{where}: {e}")
    return failures


def grads_as_torch_sees_them(name):
    """After backward, p.grad is set exactly for the parameters that got a
    grad. ddp: it is the averaged grad (torch DDP's), and torch's own
    clip_grad_norm_ works on it. Sharded: using it raises a clear error.
    model.clip_grad_norm_ returns a tensor equal to torch's norm. Then one
    p.grad is replaced (replaced_grad_stepped)."""
    failures, where = [], f"{name} world {dist.get_world_size()}"
    ref, _ = make_torch(groups=False)
    model, opt = make_tiny(name, groups=False)
    run_loop(ref, None, "plain", 0, False)
    run_loop(model, opt, "plain", 0, True)
    ref_grads = dict(ref.named_parameters())
    for n, p in model.module.named_parameters():
        if (p.grad is None) != (ref_grads[n].grad is None):
            failures.append(f"{where}: p.grad of {n} is {p.grad is None}, torch's {ref_grads[n].grad is None}")
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    if name == "ddp":
        for n, p in model.module.named_parameters():
            if p.grad is not None and not torch.allclose(p.grad, ref_grads[n].grad, rtol=RTOL, atol=ATOL):
                failures.append(f"{where}: p.grad of {n} is not the averaged grad")
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    else:
        try:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            failures.append(f"{where}: torch's clip_grad_norm_ on sharded grads did not raise")
        except RuntimeError as e:
            if "model.clip_grad_norm_" not in str(e):
                failures.append(f"{where}: unclear error {e}")
        got = model.clip_grad_norm_(1e9)
    if not isinstance(got, torch.Tensor) or abs(got.item() - expected.item()) > ATOL + RTOL * expected.item():
        failures.append(f"{where}: grad norm {got} vs torch {expected}")
    return failures + replaced_grad_stepped(name)


def replaced_grad_stepped(name):
    """A p.grad replaced by another tensor after backward, in a model whose
    every parameter got a grad: ddp steps with it, as torch does; a strategy
    that keeps averaged grads sharded refuses it."""
    where = f"{name} world {dist.get_world_size()}: a replaced p.grad"
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, WIDTH))
    wrapper_cls, opt_cls = tiny_zero.STRATEGIES[name]
    model = wrapper_cls(copy.deepcopy(ref))
    opt, ref_opt = opt_cls(model, lr=LR, weight_decay=WD), torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))  # the same rows on every rank
    for m in (ref, model):
        m(x).square().mean().backward()
    replaced = torch.full_like(ref[0].weight, 0.5)
    ref[0].weight.grad, model.module[0].weight.grad = replaced.clone(), replaced.clone()
    if name != "ddp":
        return refused(opt.step, "was replaced", where)
    ref_opt.step()
    opt.step()
    return differs_from_torch(where, model, ref)


def fp16_loss_backward(name):
    """Under fp16, loss.backward() and model.backward(loss) train alike (the
    loss scale enters where the output leaves the module), and a loss from
    model.module(...) too (it used to reach the optimizer unscaled: steps
    1/65536 of torch's, without a word); a backward that starts from a
    submodule's output, which the scale never enters, is refused."""
    states = []
    for way in ("loss.backward", "model.backward", "model.module"):
        model, opt = make_tiny(name, mixed_precision="fp16")
        for step in range(3):
            model.module.use_sometimes = True
            loss = (model.module if way == "model.module" else model)(*my_rows(global_batch(step)))
            loss.backward() if way != "model.backward" else model.backward(loss)
            opt.step()
            opt.zero_grad()
        states.append(model.full_state_dict())
    same = all(torch.equal(states[0][k], other[k]) for other in states[1:] for k in states[0])
    moved = any(not torch.equal(states[0][k], make_torch()[0].state_dict()[k]) for k in states[0])
    failures = [] if same and moved else [f"{name}: fp16 with model.backward(loss) or model.module differs"]
    x, y = my_rows(global_batch(0))
    head = model.module.head
    loss = F.cross_entropy(head(model.module.emb(x)).view(-1, head.out_features), y.reshape(-1))
    return failures + refused(loss.backward, "does not start from the model's output",
                              f"{name}: fp16 backward from a submodule's output")


def autocast_and_compile(name):
    """torch.autocast around the forward trains (close to fp32); torch.compile
    of the wrapper gives the eager numbers without recompiling per layer."""
    import torch._dynamo

    failures = []
    model, opt = make_tiny(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(*my_rows(global_batch(0)))
    loss.backward()
    opt.step()
    opt.zero_grad()
    eager, _ = make_tiny(name)
    compiled_model, _ = make_tiny(name)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(compiled_model, backend="eager")
    for step in range(2):
        x, y = my_rows(global_batch(step))
        want, got = eager(x, y), compiled(x, y)
        if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
            failures.append(f"{name}: compiled loss {got.item()} vs eager {want.item()}")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if graphs > 12:
        failures.append(f"{name}: torch.compile made {graphs} graphs for one model (recompiling per layer)")
    return failures


def agreements_per_step(name):
    """After the first step the ranks agree once per training step under ddp
    (the backward pass, with the optimizer step's check deferred into it),
    twice under zero1 and zero2 (the backward pass, the optimizer step) and
    four times under zero3 and fsdp (also the first layer gathered in forward
    and in backward), as docs/communication.md counts them; counted with the
    benchmark's own switch (example/benchmark/agreement.py), so its figures
    are per these."""
    from example.benchmark.agreement import checks
    model, opt = make_tiny(name)
    counts = []
    for step in range(3):
        sends = []
        with checks(True, sends):
            loss = model(*my_rows(global_batch(step)))
            loss.backward()
            opt.step()
            opt.zero_grad()
        counts.append(sends)
    expected = {"ddp": [["this backward pass", "the optimizer step"]],
                "zero3": 4, "fsdp": 4}.get(name, [["this backward pass"], ["the optimizer step"]])
    got = counts[1:] if isinstance(expected, list) else [len(c) for c in counts[1:]]
    return [] if got == [expected] * 2 else [f"{name}: agreements per step {counts}, expected {expected} after the first"]


def step_after_only_no_sync(name):
    """Averaged grads, no zero_grad, a backward inside no_sync() and then a
    step: zero1 refuses (it holds neither grads averaged) with a clear error,
    and steps once a backward outside no_sync() has run."""
    model, opt = make_tiny(name)
    x, y = my_rows(global_batch(0))
    model(x, y).backward()
    with model.no_sync():
        model(x, y).backward()
    failures = refused(opt.step, "no_sync()", f"{name}: a step with grads that a no_sync() backward left unaveraged")
    if failures:
        return failures
    model(x, y).backward()
    opt.step()
    return []


def each(check, names):
    return [f for name in names for f in globals()[check](name)]


def requires_grad_changed_after_wrapping(name):
    """requires_grad is read once, when wrapping: freezing or unfreezing a
    parameter afterwards is a clear error (not a silent zero grad, or a bare
    KeyError), on every rank."""
    failures = []
    for change in ("freeze", "unfreeze"):
        model, opt = make_tiny(name)
        target = model.module.fc1.weight if change == "freeze" else model.module.frozen.weight
        target.requires_grad_(change == "unfreeze")
        try:
            run_loop(model, opt, "plain", 0, True)
            opt.step()
            failures.append(f"{name}: {change} after wrapping went on without an error")
        except RuntimeError as e:
            if "when wrapping" not in str(e) and "was wrapped" not in str(e):
                failures.append(f"{name}: {change} after wrapping: unclear error {str(e)[:200]}")
    return failures


CLAMP = 0.02  # what the grad hooks clip each local grad to: most elements of fc1.weight's and emb.weight's exceed it


def hooked(module, seen):
    """A grad hook that clips this rank's grad (not linear: the average of
    the clipped grads is not the clipped average) on every parameter, and a
    post-accumulate hook that records, per backward, each p.grad it sees."""
    for n, p in module.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda grad: grad.clamp(-CLAMP, CLAMP))
            p.register_post_accumulate_grad_hook(lambda p, n=n: seen.append((n, p.grad.detach().clone())))


def torch_ddp(seen):
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    module = LoopNet()
    hooked(module, seen)
    model = DistributedDataParallel(module, find_unused_parameters=True)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, eps=1.0, weight_decay=WD)


def tiny_hooked(name, seen):
    model, opt = make_tiny(name, groups=False)
    hooked(model.module, seen)
    return model, opt


def per_step(seen):
    """The post-accumulate hooks' calls of each step, by parameter name (a
    name's calls in the order made)."""
    steps = [list(calls) for is_step, calls in groupby(seen, key=lambda call: call[0] == "step") if not is_step]
    return [sorted(calls, key=lambda call: call[0]) for calls in steps]


def grad_hooks(name):
    """p.register_hook and p.register_post_accumulate_grad_hook run as under
    torch DDP: the first once per backward with this rank's grad of that
    backward (a tied weight's two uses summed first), and what it returns is
    what is averaged; the second once per backward, with p.grad showing this
    rank's grad. Parameters after three steps (two backward passes in the
    last, the first inside no_sync) and every p.grad a post-accumulate hook
    saw equal torch DDP's. torch's MemTracker, which hooks every parameter,
    runs a step of the wrapped model and reports its peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    failures, where = [], f"{name} world {dist.get_world_size()}"
    runs = []
    for make in (torch_ddp, lambda seen: tiny_hooked(name, seen)):
        seen = []
        model, opt = make(seen)
        for step, backwards in enumerate((1, 1, 2)):
            model.module.use_sometimes = step != 1
            for micro in range(backwards):
                with model.no_sync() if micro < backwards - 1 else nullcontext():
                    model(*my_rows(global_batch(step, micro))).backward()
            seen.append(("step", None))
            opt.step()
            opt.zero_grad()
        runs.append((model, per_step(seen)))
    (ref, ref_seen), (model, seen) = runs
    ref_state = {k.removeprefix("module."): v for k, v in ref.state_dict().items()}
    for key, value in model.full_state_dict().items():
        if not torch.allclose(value, ref_state[key], rtol=RTOL, atol=ATOL):
            failures.append(f"{where}: {key} differs from torch DDP's by {(value - ref_state[key]).abs().max():.2e}")
    for mine, torchs in zip(seen, ref_seen, strict=True):
        if [n for n, _ in mine] != [n for n, _ in torchs]:
            failures.append(f"{where}: post-accumulate hooks ran for {[n for n, _ in mine]}, under torch DDP for "
                            f"{[n for n, _ in torchs]}")
            continue
        failures += [f"{where}: a post-accumulate hook saw p.grad of {n} differ from torch DDP's"
                     for (n, g), (_, want) in zip(mine, torchs) if not torch.allclose(g, want, rtol=RTOL, atol=ATOL)]
    torch.manual_seed(0)
    module = LoopNet()
    module.frozen.requires_grad_(True)  # MemTracker hooks every parameter: torch refuses a hook on a frozen one
    model = tiny_zero.STRATEGIES[name][0](module)
    opt = tiny_zero.STRATEGIES[name][1](model, lr=LR)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        model(*my_rows(global_batch(0))).backward()
        opt.step()
        opt.zero_grad()
    peak = tracker.get_tracker_snapshot("peak")
    if not peak or min(snapshot["Total"] for snapshot in peak.values()) <= 0:
        failures.append(f"{where}: MemTracker reported no peak: {peak}")
    return failures


class AuxNet(LoopNet):
    """LoopNet with two auxiliary heads that run on every rank, and whose
    losses are added where named in `aux_losses` (as for the batches that
    have an image, or a caption). heads_last: they run after the main head,
    so that a backward may begin at a layer other than the forward's last."""

    def __init__(self, heads_last=False):
        super().__init__()
        self.aux = nn.Linear(WIDTH, VOCAB)
        self.aux2 = nn.Linear(WIDTH, VOCAB, bias=False)
        self.aux_losses = ()
        self.heads_last = heads_last

    def forward(self, idx, targets):
        h = self.emb(idx)
        h = h + self.fc2(torch.tanh(self.fc1(self.ln(h))))
        order = ("head", "aux", "aux2") if self.heads_last else ("aux", "aux2", "head")
        outs = {n: getattr(self, n)(h) for n in order}
        return sum(F.cross_entropy(outs[n].view(-1, VOCAB), targets.reshape(-1)) for n in ("head", *self.aux_losses))


# step by step, the auxiliary heads in rank 0's loss and in rank 1's: one rank
# only, none (every rank misses the same grads), both, each its own (every
# rank misses some, not the same), and both on one rank
AUX_STEPS = ((("aux",), ()), ((), ()), (("aux", "aux2"), ("aux", "aux2")), (("aux",), ("aux2",)),
             ((), ("aux", "aux2")))


def head_on_some_ranks(name):
    """A head whose forward runs on every rank and whose output reaches the
    loss on some ranks only trains as under torch DDP with
    find_unused_parameters=True: a rank without its grad sends zeros, the
    parameter is averaged and stepped on every rank when some rank had a
    grad, and not stepped (p.grad None) when none had. Parameters and which
    p.grad is None after each step equal torch DDP's; with the heads run
    before the main head, and, for zero3 and fsdp, whose gathers follow the
    order the layers ran in, after it (their backward then begins, on some
    ranks, past the forward's last layer)."""
    last = aux_heads(name, heads_last=True) if name in ("zero3", "fsdp") else []
    return aux_heads(name, heads_last=False) + last


def aux_heads(name, heads_last):
    from torch.nn.parallel import DistributedDataParallel

    failures, where = [], f"{name} world {dist.get_world_size()}{', heads last' if heads_last else ''}"
    torch.manual_seed(0)
    ref = DistributedDataParallel(AuxNet(heads_last), find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=1.0, weight_decay=WD)
    torch.manual_seed(0)
    model = tiny_zero.STRATEGIES[name][0](AuxNet(heads_last), **({} if name == "fsdp" else {"bucket_bytes": 200}))
    opt = tiny_zero.STRATEGIES[name][1](model, lr=LR, eps=1.0, weight_decay=WD)
    for step, losses in enumerate(AUX_STEPS):
        for m, o in ((ref, ref_opt), (model, opt)):
            m.module.aux_losses = losses[dist.get_rank()]
            m(*my_rows(global_batch(step))).backward()
            o.step()
        got = {n: p.grad is None for n, p in model.module.named_parameters()}
        want = {n: p.grad is None for n, p in ref.module.named_parameters()}
        if got != want:
            failures.append(f"{where} step {step}: p.grad None for {sorted(n for n in got if got[n])}, under torch "
                            f"DDP for {sorted(n for n in want if want[n])}")
        ref_opt.zero_grad()
        opt.zero_grad()
        failures += differs_from_torch(f"{where} step {step}", model, ref.module)
    return failures


def torch_options_refused(name):
    """torch.optim.AdamW's amsgrad and maximize, which tiny_zero's AdamW does
    not implement, are refused wherever a param group can carry them (the
    constructor, add_param_group, a group changed before a step) instead of
    being ignored."""
    failures = []
    model, opt = make_tiny(name)
    named = dict(model.module.named_parameters())
    opt_cls = type(opt)
    attempts = {
        "constructor": lambda: opt_cls(model, [{"params": [named["fc1.weight"]], "amsgrad": True}]),
        "add_param_group": lambda: opt.add_param_group({"params": [named["sometimes.weight"]], "maximize": True}),
    }
    for where, attempt in attempts.items():
        failures += refused(attempt, "tiny_zero's AdamW has no", f"{name}: amsgrad/maximize in a group at the {where}",
                            ValueError)
    model, opt = make_tiny(name)
    run_loop(model, opt, "plain", 0, True)
    opt.param_groups[0]["amsgrad"] = True
    return failures + refused(opt.step, "has no amsgrad", f"{name}: amsgrad=True set in a group before the step",
                              ValueError)


def named_parameters_given(name):
    """The optimizer takes model.module.named_parameters(), as torch.optim does
    (and DeepSpeed's initialize, as model_parameters): the groups of
    parameters(); a tensor not in the model is refused, by its shape."""
    model, _ = make_tiny(name)
    opt_cls = tiny_zero.STRATEGIES[name][1]
    named, plain = (opt_cls(model, params, lr=LR) for params in (model.module.named_parameters(),
                                                                 model.module.parameters()))
    ids = [[[id(p) for p in g["params"]] for g in opt.param_groups] for opt in (named, plain)]
    failures = [] if ids[0] == ids[1] else [f"{name}: named_parameters() gave other param groups"]
    return failures + refused(lambda: named.add_param_group({"params": [torch.zeros(3, 4)]}),
                              "got a tensor of shape (3, 4)", f"{name}: a tensor not in the model", ValueError)


def module_state_dicts(name):
    """What torch DDP users call on model.module: load_state_dict() (of the
    module or of a submodule) reaches the fp32 masters and every rank's
    shard, so training goes on from the loaded values (bf16 parameters: the
    masters are not the module's tensors); state_dict() returns the values
    where the module holds them whole, and elsewhere (zero3, fsdp) raises
    rather than return what a rank holds between steps."""
    failures = []
    torch.manual_seed(1)
    other = LoopNet().state_dict()
    model, opt = make_tiny(name, mixed_precision="bf16")
    model.module.load_state_dict(other)
    model.module.fc1.load_state_dict({"weight": other["fc1.weight"] * 2, "bias": other["fc1.bias"]})
    want = {**other, "fc1.weight": other["fc1.weight"] * 2}
    full = model.full_state_dict()
    for key, value in want.items():
        if key.startswith("frozen."):  # no fp32 master for a frozen parameter: it is kept in bf16
            value = value.bfloat16().float()
        if not torch.equal(full[key], value):
            failures.append(f"{name}: {key} after model.module.load_state_dict differs by "
                            f"{(full[key] - value).abs().max():.2e}")
    failures += refused(lambda: model.module.load_state_dict({k: v for k, v in other.items() if k != "ln.bias"}),
                        "missing keys ['ln.bias']", f"{name}: a strict load of a state dict without ln.bias")
    for what, sub, prefix in (("model.module", model.module, ""), ("model.module.fc1", model.module.fc1, "fc1.")):
        try:
            got = sub.state_dict()
            if name in ("zero3", "fsdp"):
                failures.append(f"{name}: {what}.state_dict() returned what a rank holds between steps")
            for key, value in got.items():
                if not torch.equal(value, want[prefix + key].to(value.dtype)):
                    failures.append(f"{name}: {what}.state_dict()[{key!r}] is not the loaded value")
        except RuntimeError as e:
            if name not in ("zero3", "fsdp") or "model.state_dict()" not in str(e):
                failures.append(f"{name}: {what}.state_dict(): {str(e)[:200]}")
    return failures


def load_state_dict_hooks(name):
    """A submodule's load_state_dict hooks run under model.load_state_dict
    and model.module.load_state_dict, with the prefixes torch DDP passes: a
    pre-hook renames a legacy key and converts its value; a post-hook forgives
    a missing key, and the strict load then goes through. model.state_dict()
    gives a state_dict hook the prefix torch DDP gives ("module.fc1.")."""
    failures = []
    model, _ = make_tiny(name)
    full, calls = model.full_state_dict(), []

    def pre(module, state_dict, prefix, *rest):
        calls.append(prefix)
        if prefix + "legacy" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "legacy") * 2

    def post(module, keys):
        calls.append("post")
        keys.missing_keys[:] = [k for k in keys.missing_keys if not k.endswith("ln.bias")]

    model.module.fc1._register_load_state_dict_pre_hook(pre, with_module=True)
    model.module.fc1.register_load_state_dict_post_hook(post)
    for load, prefix in ((model.load_state_dict, "module."), (model.module.load_state_dict, "")):
        values = {prefix + k: v for k, v in full.items() if k not in ("ln.bias", "fc1.weight")}
        values[prefix + "fc1.legacy"] = full["fc1.weight"]
        calls.clear()
        load(values)
        if calls != [prefix + "fc1.", "post"]:
            failures.append(f"{name}: {prefix or 'module '}load_state_dict ran the hooks {calls}")
        off = (model.full_state_dict()["fc1.weight"] - 2 * full["fc1.weight"]).abs().max()
        if off > 0:
            failures.append(f"{name}: fc1.weight is off the pre-hook's value by {off:.2e}")
        model.load_state_dict({"module." + k: v for k, v in full.items()})
    seen = []
    model.module.fc1.register_state_dict_pre_hook(lambda module, prefix, keep_vars: seen.append(prefix))
    model.state_dict()
    if seen != ["module.fc1."]:
        failures.append(f"{name}: model.state_dict() gave fc1's state_dict hook the prefixes {seen}")
    return failures


def deep_copied(name):
    """copy.deepcopy(model.module) after a step (an EMA, a reference model)
    computes as the wrapped module does, and the wrapped model trains on as
    torch's; zero3 and fsdp, whose parameters are released between uses,
    refuse the copy on every rank, saying what to do instead."""
    failures = []
    ref, ref_opt = make_torch()
    model, opt = make_tiny(name)
    for step in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            run_loop(m, o, "plain", step, distributed=m is model)
            o.step()
            o.zero_grad()
        if step == 1 and name in ("zero3", "fsdp"):
            failures += refused(lambda: copy.deepcopy(model.module), "full_state_dict()", f"{name}: deepcopy",
                                TypeError)
        elif step == 1:
            copied = copy.deepcopy(model.module)
            with torch.no_grad():
                x, y = my_rows(global_batch(7))
                if not torch.equal(copied(x, y), model.module(x, y)):
                    failures.append(f"{name}: the deep copy of model.module computes another loss")
    return failures + differs_from_torch(f"{name}: after a deepcopy", model, ref)


def second_backward_refused(name):
    """backward(retain_graph=True), then backward again through the same
    forward: plain torch adds the grads twice, torch DDP refuses; each
    strategy refuses too, on every rank, naming the layer (its grads were
    sent after the first)."""
    model, opt = make_tiny(name)
    x, y = my_rows(global_batch(0))
    loss = model(x, y)
    loss.backward(retain_graph=True)
    return refused(loss.backward, "head: a second backward through the same forward",
                   f"{name}: a second backward through the same forward")


def in_place_writes(name):
    """A parameter written in place after wrapping (a pruning mask, a zeroed
    bias) keeps the write, as in torch: the next step starts from it, where
    the optimizer steps fp32 masters apart from the parameters (bf16; offload)
    as well as where it steps them. Against the same strategy given the same
    values through model.load_state_dict. fsdp holds only slices between
    steps: the write fails on every rank (zero3's owner of a tensor holds it
    whole, tensor_checks.in_place_writes has the refusal at the step)."""
    failures = []
    mask = (torch.arange(WIDTH * HIDDEN).view(HIDDEN, WIDTH) % 3 != 0).float()
    for precision in ("bf16", None):
        written, loaded = (make_tiny(name, mixed_precision=precision) for _ in range(2))
        for model, opt in (written, loaded):
            model(*my_rows(global_batch(0))).backward()
            opt.step()
            opt.zero_grad()
        if name == "fsdp":
            failures += write_while_released(written[0], mask)
            continue
        want = loaded[0].full_state_dict()
        want["fc1.weight"] = want["fc1.weight"] * mask
        want["fc1.bias"] = torch.zeros_like(want["fc1.bias"])
        loaded[0].module.load_state_dict(want)
        with torch.no_grad():
            written[0].module.fc1.weight.mul_(mask.to(written[0].module.fc1.weight.dtype))
            nn.init.zeros_(written[0].module.fc1.bias)
        for when in ("after the write", "after the next step"):
            got, ref = written[0].full_state_dict(), loaded[0].full_state_dict()
            for key in ref:
                if not torch.equal(got[key], ref[key]):
                    failures.append(f"{name} ({precision or 'fp32'}): {key} {when} differs from the loaded "
                                    f"values by {(got[key] - ref[key]).abs().max():.2e}")
            for model, opt in (written, loaded):
                model(*my_rows(global_batch(1))).backward()
                opt.step()
                opt.zero_grad()
    return failures


def write_while_released(model, mask):
    try:
        with torch.no_grad():
            model.module.fc1.weight.mul_(mask.to(model.module.fc1.weight.dtype))
        return ["fsdp: a write into a released parameter went on without an error"]
    except RuntimeError:
        return []  # torch's own error: a released parameter is one shared zero


def grads_cleared_outside_zero_grad(name):
    """p.grad set to None without zero_grad() clears that grad, as in torch:
    `p.grad = None` for some parameters after backward (they drop out of the
    clipped norm and are not stepped), then model.module.zero_grad() or a
    loop of `p.grad = None` (torch's cheap zero_grad) in place of
    opt.zero_grad(). Every step's grad norm and parameters equal torch's."""
    failures, where = [], f"{name} world {dist.get_world_size()}"
    ref, ref_opt = make_torch()
    model, opt = make_tiny(name)
    for step in range(4):
        norms = []
        for m, o, module in ((ref, ref_opt, ref), (model, opt, model.module)):
            run_loop(m, o, "plain", step, distributed=m is model)
            if step % 2:
                for p in module.fc1.parameters():
                    p.grad = None
            norms.append(model.clip_grad_norm_(0.5) if m is model else nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
            o.step()
            if step % 2:
                module.zero_grad()
            else:
                for p in module.parameters():
                    p.grad = None
        if abs(norms[1].item() - norms[0].item()) > ATOL + RTOL * norms[0].item():
            failures.append(f"{where} step {step}: grad norm {norms[1].item()} vs torch {norms[0].item()}")
        failures += differs_from_torch(f"{where} step {step}", model, ref)
    return failures


def autograd_grad_refused(name):
    """torch.autograd.grad(loss, h) through a strategy's layers, where torch
    would leave p.grad alone, and a backward with create_graph=True (a gradient
    penalty) raise on every rank, before any collective; a training step
    after them equals torch's."""
    failures, where = [], f"{name} world {dist.get_world_size()}"
    ref, ref_opt = make_torch()
    model, opt = make_tiny(name)
    seen = []
    hook = model.module.ln.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    for create_graph, expected in ((False, "torch.autograd.grad"), (True, "create_graph=True")):
        loss = model(*my_rows(global_batch(0)))
        failures += refused(lambda: torch.autograd.grad(loss, seen[-1], create_graph=create_graph), expected,
                            f"{where}: autograd.grad (create_graph={create_graph})")
    hook.remove()
    for m, o in ((ref, ref_opt), (model, opt)):
        run_loop(m, o, "plain", 0, distributed=m is model)
        o.step()
    return failures + differs_from_torch(f"{where} after the refusals", model, ref)


def eval_under_no_grad(name):
    """Forwards under torch.no_grad() between training steps (an evaluation)
    leave no trace in the backward's bookkeeping: on every rank, and, where
    every rank holds whole parameters, on rank 0 alone through model.module
    (as torch DDP users evaluate), the next training step is torch's."""
    failures, where = [], f"{name} world {dist.get_world_size()}"
    ref, ref_opt = make_torch()
    model, opt = make_tiny(name)
    for step in range(3):
        with torch.no_grad():
            model(*my_rows(global_batch(10 + step)))
            if model.params_whole_between_steps and dist.get_rank() == 0:
                model.module(*my_rows(global_batch(20 + step)))
        if model.used:
            failures.append(f"{where} step {step}: a forward under no_grad was recorded for a backward")
        for m, o in ((ref, ref_opt), (model, opt)):
            run_loop(m, o, "plain", step, distributed=m is model)
            o.step()
            o.zero_grad()
        failures += differs_from_torch(f"{where} step {step}", model, ref)
    return failures


class OutsideNet(LoopNet):
    """LoopNet whose LayerNorm weight is used once more, outside its layer."""

    def forward(self, idx, targets):
        h = self.emb(idx)
        h = h + self.fc2(torch.tanh(self.fc1(self.ln(h)))) * self.ln.weight
        return F.cross_entropy(self.head(h).view(-1, VOCAB), targets.reshape(-1))


def parameter_used_outside_its_layer(name):
    """A parameter used outside the layer that holds it gets that use's grad
    from autograd, which no strategy sees: the backward raises on every rank,
    naming it (ddp stepped with that part of the grad alone, without a word).
    zero3 and fsdp hold it released there: the forward raises at the read."""
    torch.manual_seed(0)
    wrapper_cls, _ = tiny_zero.STRATEGIES[name]
    model = wrapper_cls(OutsideNet(), **({} if name == "fsdp" else {"bucket_bytes": 200}))
    released = name in ("zero3", "fsdp") and dist.get_world_size() > 1
    expected = "ln.weight was read while released" if released else "ln.weight got a grad from autograd"
    return refused(lambda: model(*my_rows(global_batch(0))).backward(), expected,
                   f"{name}: a parameter used outside its layer")


def clipping_as_torch(name):
    """What reads or adds to the grads after model.clip_grad_norm_ sees them
    clipped, as after torch's clip_grad_norm_: a second clip (its norm), a
    second step after one backward, a backward without zero_grad before it,
    a backward between the clip and the step. Norms and parameters equal
    torch's after every step."""
    failures, where = [], f"{name} world {dist.get_world_size()}"
    ref, ref_opt = make_torch()
    model, opt = make_tiny(name)
    for step in range(3):
        norms = []
        for m, o, clip in ((ref, ref_opt, lambda max_norm=0.3: nn.utils.clip_grad_norm_(ref.parameters(), max_norm)),
                           (model, opt, lambda max_norm=0.3: model.clip_grad_norm_(max_norm))):
            run_loop(m, o, "plain", step, distributed=m is model)
            norms.append(clip())
            if step == 1 and name == "ddp":  # p.grad shows the grads: an edit in place sees them clipped
                for p in (ref if m is ref else model.module).parameters():
                    if p.grad is not None:
                        p.grad.add_(0.01)  # not a multiple: it does not commute with the clip
            norms.append(clip())  # the second: of the clipped grads
            norms.append(clip(100.0))  # a max_norm above the norm changes nothing
            if step == 2:
                run_loop(m, o, "plain", step + 10, distributed=m is model)  # added to the clipped grads
            o.step()
            if step == 0:
                o.step()  # with the same, clipped, grads
            else:
                o.zero_grad()  # step 0's grads carry into step 1, clipped
        for mine, torchs in zip(norms[3:], norms[:3]):
            if abs(mine.item() - torchs.item()) > ATOL + RTOL * torchs.item():
                failures.append(f"{where} step {step}: grad norm {mine.item()} vs torch {torchs.item()}")
        failures += differs_from_torch(f"{where} step {step}", model, ref)
    return failures


def grad_scaler(name):
    """torch.amp.GradScaler, as torch users write it (scale, backward,
    unscale_, clip_grad_norm_ of the parameters, step, update): ddp, whose
    p.grad is the whole averaged grad, trains as torch; the strategies that
    keep grads sharded raise, naming the wrapper's fp16 loss scaler instead."""
    where = f"{name} world {dist.get_world_size()}"
    ref, ref_opt = make_torch()
    model, opt = make_tiny(name)
    for m, o in ((ref, ref_opt), (model, opt)):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(3):
            (model.module if m is model else m).use_sometimes = step % 2 == 0
            loss = m(*(my_rows(global_batch(step)) if m is model else global_batch(step)))
            scaler.scale(loss).backward()
            if name != "ddp" and m is model:
                return refused(lambda: scaler.unscale_(o), "GradScaler unscales p.grad, which "
                               f"{type(model).__name__} keeps sharded", f"{where}: GradScaler.unscale_")
            scaler.unscale_(o)
            nn.utils.clip_grad_norm_(m.parameters(), 0.3)
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    return differs_from_torch(where, model, ref)


def converted_after_wrapping(name):
    """model.double(), model.module.to(torch.bfloat16) after wrapping are
    refused (the strategy would step its own buffers while the module
    computed with converted copies that never train: every parameter stayed
    as it was, without a word); a conversion that changes nothing
    (model.to("cpu", torch.float32) on an fp32 CPU model) is allowed, and
    training goes on as torch's."""
    where = f"{name} world {dist.get_world_size()}"
    model, opt = make_tiny(name)
    failures = refused(model.double, "converting the model after wrapping", f"{where}: model.double()")
    failures += refused(lambda: model.module.to(torch.bfloat16), "converting the model after wrapping",
                        f"{where}: model.module.to(torch.bfloat16)")
    ref, ref_opt = make_torch()
    model, opt = make_tiny(name)
    model.to("cpu", torch.float32)
    for step in range(2):
        for m, o in ((ref, ref_opt), (model, opt)):
            run_loop(m, o, "plain", step, distributed=m is model)
            o.step()
            o.zero_grad()
    return failures + differs_from_torch(where, model, ref)
