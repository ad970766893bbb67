"""Worker functions for tests/test_tensor.py (run on every rank): tensor
parallelism against single-process torch (nn layers, torch.optim.AdamW, the
concatenated batch of the replicas), and what it holds and sends.

TPNet has two transformer blocks: attention with separate q, k (bias=False),
v and o, then one with a fused [q; k; v] (split in 3 parts); an MLP up and
down (bias=False) in each; LayerNorms, a token and a position embedding, and
a head tied to the token embedding (whole on every rank)."""
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tiny_zero import checkpoint, comm
from tiny_zero.measure.memory import TensorMemory
from tiny_zero.tensor import TensorParallel, TensorParallelAdamW
from harness import module_state_dict_failures

VOCAB, WIDTH, HEADS, HIDDEN, SEQ = 13, 16, 4, 24, 6
ROWS = 6  # the global batch: one set of rows per replica (1 or 2 of them), and 3 ranks' worth for fsdp
LR, WD, STEPS = 1e-2, 0.1, 5
ATOL = 1e-4  # every parameter, after every step
LOSS_RTOL = 1e-5
MODES = {  # name: (eps, clip max_norm, micro-batches per step)
    "plain": (1e-8, None, 1),
    "eps1": (1.0, None, 1),  # summing instead of averaging grads would show here
    "clip": (1e-8, 0.5, 1),
    "no_sync": (1e-8, None, 2),
}
PLAN = {"*.q": "column", "*.k": "column", "*.v": "column", "*.qkv": ("column", 3), "*.o": "row",
        "*.up": "column", "*.down": "row"}
BLOCKS = 2


class Attention(nn.Module):
    def __init__(self, fused):
        super().__init__()
        self.fused = fused
        if fused:  # [q; k; v] rows; no bias: the key's bias gets a grad of exactly 0 in exact arithmetic
            self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        else:
            self.q, self.k, self.v = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH)
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1) if self.fused else (self.q(x), self.k(x), self.v(x))
        q, k, v = (z.view(b, t, -1, WIDTH // HEADS).transpose(1, 2) for z in (q, k, v))  # the local heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, fused):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(WIDTH), Attention(fused)
        self.ln2 = nn.LayerNorm(WIDTH, bias=False)
        self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList([Block(fused=False), Block(fused=True)])
        self.sometimes = nn.Linear(WIDTH, WIDTH)  # whole; used only while use_sometimes is set
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.use_sometimes = True

    def forward(self, idx, targets):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        if self.use_sometimes:
            x = x + torch.tanh(self.sometimes(x))
        return F.cross_entropy(self.head(self.ln(x)).view(-1, VOCAB), targets.reshape(-1))


def split_names(module):
    """The parameters the plan splits: weights of the planned Linears, biases of the column ones."""
    names = []
    for name, layer in module.named_modules():
        kind = next((PLAN[p] for p in PLAN if name.endswith(p[1:])), None)
        if kind is not None:
            names += [f"{name}.weight"] + ([f"{name}.bias"] if layer.bias is not None and kind != "row" else [])
    return names


def global_batch(step, micro=0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def replica_rows(model, tensors):
    """The rows of this rank's replica: every rank of a tensor group gets the same."""
    n = ROWS // model.replicas
    return [t[model.replica * n:(model.replica + 1) * n] for t in tensors]


def wrap(tp_size, net=TPNet, **options):
    torch.manual_seed(0)
    return TensorParallel(net(), PLAN, tp_size=tp_size, bucket_bytes=300, **options)


def reference(mode, steps=STEPS, sometimes=lambda step: True):
    """Single-process torch: per step the loss, the clip norm and the state."""
    eps, clip, micro = MODES[mode]
    torch.manual_seed(0)
    model = TPNet()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps, weight_decay=WD)
    history = []
    for step in range(steps):
        model.use_sometimes = sometimes(step)
        total = 0.0
        for m in range(micro):
            loss = model(*global_batch(step, m)) / micro
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() if clip else None
        opt.step()
        opt.zero_grad()
        history.append((total, norm, {k: v.clone() for k, v in model.state_dict().items()}))
    return history


def step(model, opt, step, micro=1, clip=None):
    """One training step on this replica's rows; returns the loss averaged over replicas."""
    total = torch.zeros(())
    for m in range(micro):
        with model.no_sync() if m < micro - 1 else nullcontext():
            loss = model(*replica_rows(model, global_batch(step, m))) / micro
            model.backward(loss)
        total += loss.detach()
    norm = model.clip_grad_norm_(clip) if clip else None
    opt.step()
    opt.zero_grad()
    dist.all_reduce(total)  # the ranks of a tensor group hold the same loss: the mean over ranks is over replicas
    return total.item() / dist.get_world_size(), norm


def compare(where, state, ref_state):
    return [f"{where}: {k} differs by {(state[k] - v).abs().max().item():.2e}"
            for k, v in ref_state.items() if not torch.allclose(state[k], v, rtol=0, atol=ATOL)]


def parity(tp_size, modes):
    """Losses, clip norms and every parameter after every step equal torch's;
    the whole parameters' grads are equal on every rank of a tensor group."""
    failures = []
    for mode in modes:
        eps, clip, micro = MODES[mode]
        ref = reference(mode)
        model = wrap(tp_size)
        opt = TensorParallelAdamW(model, lr=LR, eps=eps, weight_decay=WD)
        worst = 0.0
        for n in range(STEPS):
            if n == 1:
                failures += unequal_whole_grads(model, global_batch(n), f"{mode} tp {tp_size}")
            loss, norm = step(model, opt, n, micro, clip)
            ref_loss, ref_norm, ref_state = ref[n]
            where = f"{mode} tp {tp_size} x {model.replicas} step {n}"
            if abs(loss - ref_loss) > LOSS_RTOL * abs(ref_loss):
                failures.append(f"{where}: loss {loss} vs torch {ref_loss}")
            if clip and abs(norm.item() - ref_norm) > LOSS_RTOL * ref_norm:
                failures.append(f"{where}: clip norm {norm.item()} vs torch {ref_norm}")
            state = model.full_state_dict()
            failures += compare(where, state, ref_state)
            worst = max(worst, max((state[k] - v).abs().max().item() for k, v in ref_state.items()))
        failures += unequal_whole_params(model, f"{mode} tp {tp_size}")
        if dist.get_rank() == 0:
            print(f"parity {mode} tp {tp_size} x {model.replicas}: largest parameter difference {worst:.2e}")
    return failures


def gathered_in_group(model, tensor):
    """Every rank of this rank's tensor group's copy of `tensor` (plain torch.distributed: not counted)."""
    copies = [torch.empty_like(tensor) for _ in range(model.tp_size)]
    dist.all_gather(copies, tensor.contiguous(), group=model.tensor_group)
    return copies


def unequal_whole_grads(model, batch, where):
    """After a backward (replica averaging included): each whole parameter's
    grad is bitwise the same on every rank of the tensor group, and each slice
    differs from the others (the test would pass vacuously otherwise)."""
    model.backward(model(*replica_rows(model, batch)))
    failures = []
    for name, p in model.named_params:
        grad = model.buckets.of[p].view(model.flat_grads, p)
        copies = gathered_in_group(model, grad)
        same = all(torch.equal(c, copies[0]) for c in copies)
        if (p in model.split) == same and model.tp_size > 1:
            failures.append(f"{where}: the grads of {name} ({'sliced' if p in model.split else 'whole'}) "
                            f"are {'the same' if same else 'different'} on the ranks of a tensor group")
    model.zero_grad()
    return failures


def unequal_whole_params(model, where):
    return [f"{where}: whole parameter {name} differs across the tensor group"
            for name, p in model.named_params if p not in model.split
            and not all(torch.equal(c, p.data) for c in gathered_in_group(model, p.data))]


def comm_per_step(tp_size):
    """One step's collectives, counted by tiny_zero.comm: in forward and in backward separately."""
    model = wrap(tp_size)
    opt = TensorParallelAdamW(model, lr=LR)
    x, y = replica_rows(model, global_batch(0))
    comm.stats.reset()
    loss = model(x, y)
    forward = (dict(comm.stats.calls), dict(comm.stats.bytes))
    comm.stats.reset()
    model.backward(loss)
    backward = (dict(comm.stats.calls), dict(comm.stats.bytes))
    comm.stats.reset()
    model.clip_grad_norm_(1.0)
    opt.step()
    after = (dict(comm.stats.calls), dict(comm.stats.bytes))
    held = sum(p.numel() for p in model.trainable)  # this rank's slices and whole parameters
    return dict(forward=forward, backward=backward, after=after, tokens=x.numel(), held=held,
                buckets=len(model.buckets.list), replicas=model.replicas)


def memory(tp_size):
    """Bytes of parameters, grads and optimizer state this rank holds after a
    step (tiny_zero.measure.memory), under tensor parallelism and under ddp,
    and the elements of each parameter it holds."""
    from tiny_zero.ddp import DDP, DDPAdamW
    held = {}
    for name, make in (("tensor", lambda: wrap(tp_size)), ("ddp", lambda: DDP(TPNet(), bucket_bytes=300))):
        with TensorMemory() as counter:
            torch.manual_seed(0)
            model = make()
            opt = (TensorParallelAdamW if name == "tensor" else DDPAdamW)(model, lr=LR)
            counter.attach(model, opt)
            step(model, opt, 0)
            held[name] = {k: v for k, v in counter.breakdown().items()
                          if k in ("parameters", "gradients", "optimizer_state")}
        if name == "tensor":
            elements = {n: p.numel() for n, p in model.named_params}
    return dict(held=held, elements=elements)


def pieces_cover_the_model(tp_size):
    """Every element of every parameter: held (pieces()) by every replica once,
    and saved (pieces_to_save()) by exactly one rank, with the model's values."""
    model = wrap(tp_size)
    full = model.full_state_dict()
    held = {n: torch.zeros(p.numel(), dtype=torch.int32) for n, p in TPNet().named_parameters()}
    saved = {n: torch.zeros_like(c) for n, c in held.items()}
    wrong = []
    for counts, pieces in ((held, model.pieces()), (saved, model.pieces_to_save())):
        for piece in pieces:
            counts[piece.name][piece.lo:piece.hi] += 1
            value = piece.tensor[piece.offset:piece.offset + piece.hi - piece.lo]
            if not torch.equal(value, full[piece.name].reshape(-1)[piece.lo:piece.hi]):
                wrong.append(f"rank {dist.get_rank()}: {piece.name}[{piece.lo}:{piece.hi}] holds other values")
    for name in held:
        dist.all_reduce(held[name])
        dist.all_reduce(saved[name])
        whole = name not in split_names(TPNet())
        if not bool((held[name] == (dist.get_world_size() if whole else model.replicas)).all()):
            wrong.append(f"{name} is held {held[name].min().item()}..{held[name].max().item()} times")
        if not bool((saved[name] == 1).all()):
            wrong.append(f"{name} is saved {saved[name].min().item()}..{saved[name].max().item()} times")
    return wrong


# ---------------------------------------------------------------- checkpoints

SAVE_AT = 3


def save_and_resume(root, tp_size):
    """Train to SAVE_AT, save, go on to STEPS; a fresh model that loads goes on
    to exactly the same parameters; consolidating gives full_state_dict. The
    checkpoint stays in `root` for the next worlds (fsdp at 3 ranks loads it)."""
    path = f"{root}/tensor"
    model = wrap(tp_size)
    opt = TensorParallelAdamW(model, lr=LR, eps=1.0, weight_decay=WD)
    for n in range(SAVE_AT):
        step(model, opt, n)
    checkpoint.save(path, model, opt, step=SAVE_AT)
    failures = [f"consolidated {k} is not full_state_dict's" for k, v in model.full_state_dict().items()
                if not torch.equal(checkpoint.consolidate(path)[k], v)]
    for n in range(SAVE_AT, STEPS):
        step(model, opt, n)
    fresh = wrap(tp_size)
    fresh_opt = TensorParallelAdamW(fresh, lr=LR, eps=1.0, weight_decay=WD)
    if checkpoint.load(path, fresh, fresh_opt)["step"] != SAVE_AT:
        failures.append("the step did not come back")
    for n in range(SAVE_AT, STEPS):
        step(fresh, fresh_opt, n)
    final = model.full_state_dict()
    failures += [f"resumed {k} differs" for k, v in fresh.full_state_dict().items() if not torch.equal(v, final[k])]
    return failures + compare(f"tensor tp {tp_size} x {model.replicas}", final, reference("eps1")[-1][2])


def load_into_fsdp(root):
    """fsdp (at 3 ranks here) loads what tensor parallelism saved, saves it
    again, and trains on to torch's numbers."""
    from tiny_zero.fsdp import FSDP, FSDPAdamW
    torch.manual_seed(0)
    model = FSDP(TPNet())
    opt = FSDPAdamW(model, lr=LR, eps=1.0, weight_decay=WD)
    checkpoint.load(f"{root}/tensor", model, opt)
    checkpoint.save(f"{root}/fsdp", model, opt, step=SAVE_AT)
    ref = reference("eps1")
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    for n in range(SAVE_AT, STEPS):
        x, y = (t[rank * ROWS // world:(rank + 1) * ROWS // world] for t in global_batch(n))
        model.backward(model(x, y))
        opt.step()
        opt.zero_grad()
        failures += compare(f"fsdp at {world} step {n}", model.full_state_dict(), ref[n][2])
    return failures


def load_back(root, tp_size):
    """Tensor parallelism loads what fsdp saved and trains on to torch's numbers."""
    model = wrap(tp_size)
    opt = TensorParallelAdamW(model, lr=LR, eps=1.0, weight_decay=WD)
    checkpoint.load(f"{root}/fsdp", model, opt)
    ref = reference("eps1")
    failures = []
    for n in range(SAVE_AT, STEPS):
        step(model, opt, n)
        failures += compare(f"tensor tp {tp_size} from fsdp, step {n}", model.full_state_dict(), ref[n][2])
    return failures


# ---------------------------------------------------------------- torch's training loop

FROZEN = "blocks.0.up"  # a column Linear, frozen: split, never stepped nor sent


def freeze(module):
    module.get_submodule(FROZEN).requires_grad_(False)
    return module


def groups(module, by_name):
    named = dict(module.named_parameters())
    decay = [p for n, p in named.items() if p.dim() >= 2 and n != "emb.weight"]
    return [{"params": decay}, {"params": [p for p in named.values() if p.dim() < 2], "weight_decay": 0.0},
            {"params": ["emb.weight"] if by_name else [named["emb.weight"]], "lr": LR / 2}]


def training_loop(tp_size):
    """A frozen column Linear, a layer used on alternate steps, param groups
    (by parameter and by name), a LambdaLR warm-up, two backward passes per
    step, cleared by zero_grad() of the optimizer or of the module: torch's
    numbers; the frozen layer never moves; p.grad is set exactly
    where torch's is, a ShardedGrad for a slice and the averaged grad for a
    whole parameter."""
    torch.manual_seed(0)
    ref = freeze(TPNet())
    ref_opt = torch.optim.AdamW(groups(ref, by_name=False), lr=LR, eps=1.0, weight_decay=WD)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda n: min(1.0, (n + 1) / 3))
    model = wrap(tp_size, lambda: freeze(TPNet()))
    opt = TensorParallelAdamW(model, groups(model.module, by_name=True), lr=LR, eps=1.0, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: min(1.0, (n + 1) / 3))
    initial = {k: v.clone() for k, v in ref.state_dict().items() if k.startswith(FROZEN)}
    failures = []
    for n in range(4):
        ref.use_sometimes = model.module.use_sometimes = n % 2 == 0
        for micro in range(2):
            (ref(*global_batch(n, micro)) / 2).backward()
            model.backward(model(*replica_rows(model, global_batch(n, micro))) / 2)
        for name, p in model.module.named_parameters():
            theirs = ref.get_parameter(name).grad
            if (p.grad is None) != (theirs is None):
                failures.append(f"step {n}: p.grad of {name} is {p.grad}, torch's {theirs is None and 'None'}")
            elif p.grad is not None and p not in model.split and not torch.allclose(p.grad, theirs, atol=1e-6):
                failures.append(f"step {n}: p.grad of {name} is not torch's grad")
            elif p.grad is not None and p in model.split and type(p.grad).__name__ != "ShardedGrad":
                failures.append(f"step {n}: p.grad of the slice {name} is a {type(p.grad).__name__}")
        for o, s, m in ((ref_opt, ref_sched, ref), (opt, sched, model.module)):
            o.step()
            s.step()
            o.zero_grad() if n % 2 else m.zero_grad()  # p.grad = None outside the optimizer: the grads go too
        failures += compare(f"loop tp {tp_size} step {n}", model.full_state_dict(), ref.state_dict())
        failures += [f"step {n}: frozen {k} moved" for k, v in initial.items()
                     if not torch.equal(model.full_state_dict()[k], v)]
    return failures


def state_dicts(tp_size):
    """model.state_dict() is full, on every rank, and loads into a fresh
    wrapper and into plain torch (and model.module's, harness.py); the optimizer's state_dict loads back where
    it was made, and training goes on identically."""
    model = wrap(tp_size)
    opt = TensorParallelAdamW(model, lr=LR, eps=1.0, weight_decay=WD)
    for n in range(2):
        step(model, opt, n)
    full = model.full_state_dict()
    fresh = wrap(tp_size)
    fresh_opt = TensorParallelAdamW(fresh, lr=LR, eps=1.0, weight_decay=WD)
    fresh.load_state_dict(model.state_dict())
    fresh_opt.load_state_dict(opt.state_dict())
    plain = TPNet()
    plain.load_state_dict({k.removeprefix("module."): v for k, v in model.state_dict().items()})
    failures = [f"{k}: plain torch did not get it" for k, v in plain.state_dict().items() if not torch.equal(v, full[k])]
    for m, o in ((model, opt), (fresh, fresh_opt)):
        step(m, o, 2)
    final = model.full_state_dict()
    failures += module_state_dict_failures(wrap(tp_size), final)
    return failures + [f"{k}: training after load_state_dict differs" for k, v in fresh.full_state_dict().items()
                       if not torch.equal(v, final[k])]


# ---------------------------------------------------------------- precision, the example GPT, errors

def precision(tp_size):
    """bf16 and fp16 track fp32 (loss within 5e-2); full_state_dict gives the
    fp32 masters; an fp16 overflow on one rank skips the step on every rank."""
    from tiny_zero.precision import LossScaler
    runs = {}
    for mp, options in ((None, {}), ("bf16", {}), ("fp16", {"loss_scaler": LossScaler(init_scale=2**8)})):
        model = wrap(tp_size, mixed_precision=mp, **options)
        opt = TensorParallelAdamW(model, lr=LR, weight_decay=WD)
        runs[mp] = ([step(model, opt, n, clip=0.5)[0] for n in range(3)], model, opt)
    failures = [f"{mp} step {n}: loss {a} vs fp32 {b}" for mp in ("bf16", "fp16")
                for n, (a, b) in enumerate(zip(runs[mp][0], runs[None][0])) if abs(a - b) > 5e-2 * abs(b)]
    _, model, opt = runs["fp16"]
    state = model.full_state_dict()
    if any(v.dtype != torch.float32 for v in state.values()) or \
            all(torch.equal(v, v.half().float()) for v in state.values()):
        failures.append("fp16: full_state_dict does not give the fp32 masters")
    loss = model(*replica_rows(model, global_batch(9)))
    if dist.get_rank() == 1:
        loss = loss * float("inf")
    model.backward(loss)
    opt.step()
    opt.zero_grad()
    if opt.skipped_steps != 1 or any(not torch.equal(v, state[k]) for k, v in model.full_state_dict().items()):
        failures.append(f"fp16: an overflow on rank 1 did not skip the step here (skipped {opt.skipped_steps})")
    return failures


def example_gpt(plan, checkpoint_activations):
    """The example GPT (its fused c_attn split in 3 parts) with example/tensor's
    plan equals single-process torch; the activations' all-reduces are 4 per
    block and step (6 when checkpointed blocks run their forward again)."""
    from example.model import build_model
    torch.manual_seed(0)
    ref = build_model("tiny", checkpoint_activations=checkpoint_activations)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1.0)
    model = TensorParallel(build_model("tiny", checkpoint_activations=checkpoint_activations), plan)
    opt = TensorParallelAdamW(model, lr=1e-3, eps=1.0)
    g = torch.Generator().manual_seed(0)
    failures, calls = [], []
    for n in range(3):
        tokens = torch.randint(0, 256, (2, 17), generator=g)
        ref_loss = ref(tokens[:, :-1], tokens[:, 1:])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        comm.stats.reset()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        model.backward(loss)
        calls.append(comm.stats.calls["all_reduce"])
        opt.step()
        opt.zero_grad()
        if abs(loss.item() - ref_loss.item()) > LOSS_RTOL * ref_loss.item():
            failures.append(f"gpt step {n}: loss {loss.item()} vs torch {ref_loss.item()}")
        failures += compare(f"gpt step {n}", model.full_state_dict(), ref.state_dict())
    per_block = 6 if checkpoint_activations else 4
    if calls != [per_block * ref.config.n_layer] * 3:
        failures.append(f"gpt: {calls} all-reduces per step, not {per_block} per block")
    return failures


def bad_plans():
    """Each bad plan raises a clear error before anything is sent. Only rank 0
    tries them: a collective among the checks would leave it waiting for the
    others, and the test would time out."""
    if dist.get_rank() != 0:
        return {}
    torch.manual_seed(0)
    cases = {
        "column": (nn.Sequential(nn.Linear(4, 5)), {"0": "column"}, {}),
        "row": (nn.Sequential(nn.Linear(5, 4)), {"0": "row"}, {}),
        "parts": (nn.Sequential(nn.Linear(4, 8)), {"0": ("column", 3)}, {}),
        "kind": (TPNet(), {"*.q": "columns"}, {}),
        "nothing": (TPNet(), {"*.query": "column"}, {}),
        "not_linear": (TPNet(), {"*.ln1": "column"}, {}),
        "tied": (TPNet(), {"head": "row"}, {}),
        "two_ways": (TPNet(), {"blocks.0.attn.q": "column", "*.q": "row"}, {}),
        "tp_size": (TPNet(), PLAN, {"tp_size": 3}),
    }
    errors = {}
    for case, (module, plan, options) in cases.items():
        try:
            TensorParallel(module, plan, **options)
            errors[case] = None
        except (TypeError, ValueError) as e:
            errors[case] = f"{type(e).__name__}: {e}"
    return errors


def in_place_writes(tp_size):
    """A write into a split parameter's slice in place (here: halving a column
    weight) lasts in fp32, where the slice is a view of what the optimizer
    steps: as the same values loaded. Under bf16 the optimizer steps fp32
    masters of the slices, and the write cannot be carried into them: every
    rank raises at the step instead of losing it."""
    name = "blocks.0.attn.q.weight"
    failures = []
    for mp in (None, "bf16"):
        written, loaded = wrap(tp_size, mixed_precision=mp), wrap(tp_size, mixed_precision=mp)
        opts = [TensorParallelAdamW(m, lr=LR, weight_decay=WD) for m in (written, loaded)]
        for model, opt in zip((written, loaded), opts):
            step(model, opt, 0)
        want = loaded.full_state_dict()
        want[name] = want[name] * 0.5
        loaded.load_state_dict(want)
        with torch.no_grad():
            written.module.get_parameter(name).mul_(0.5)
        try:
            for model, opt in zip((written, loaded), opts):
                step(model, opt, 1)
        except RuntimeError as e:
            if mp is None or f"{name} was written in place after wrapping" not in str(e):
                failures.append(f"{mp or 'fp32'}: {str(e)[:200]}")
            continue
        if mp is not None:
            failures.append("bf16: a write into a slice was lost without an error")
            continue
        got = written.full_state_dict()
        failures += [f"fp32: {k} after a write in place differs from the loaded values"
                     for k, v in loaded.full_state_dict().items() if not torch.equal(v, got[k])]
    return failures


# ---------------------------------------------------------------- what a plan must be (Hugging Face Llama)

LLAMA_PLAN = {"*.q_proj": "column", "*.k_proj": "column", "*.v_proj": "column", "*.o_proj": "row",
              "*.gate_proj": "column", "*.up_proj": "column", "*.down_proj": "row"}  # Megatron's


def llama_megatron():
    """transformers' Llama (grouped-query attention, RMSNorm, untied head)
    with Megatron's plan, on the global batch at tp = the world: torch's
    losses and parameters after every step."""
    from hf_checks import EPS, LR, RTOL, WD, build, global_batch, loss_of, reference
    model = TensorParallel(build("llama"), LLAMA_PLAN)
    opt = TensorParallelAdamW(model, lr=LR, eps=EPS, weight_decay=WD)
    failures = []
    for n, (ref_loss, ref_state) in enumerate(reference("llama", 1)):
        loss = loss_of(model, *global_batch(n, 1))
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        if abs(loss.item() - ref_loss) > RTOL * abs(ref_loss):
            failures.append(f"llama step {n}: loss {loss.item()} vs torch {ref_loss}")
        failures += compare(f"llama step {n}", model.full_state_dict(), ref_state)
    return failures


def refused_plans():
    """Plans that cannot compute the unsplit model's function (or its grads:
    Qwen3's q_norm and k_norm would see one rank's heads): every rank raises
    the same error at wrap time, before anything is sent. {case: the error,
    or None where the plan was taken; "case sent": the collectives sent}."""
    from example.model import build_model
    from example.tensor.train import PLAN as GPT_PLAN
    import transformers
    from hf_checks import SMALL, build
    qwen3 = lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=8))  # noqa: E731
    cases = {
        "q_and_o_only": (lambda: build("llama"), {"*.q_proj": "column", "*.o_proj": "row"}),
        "lm_head_column": (lambda: build("llama"), {**LLAMA_PLAN, "lm_head": "column"}),
        "kv_heads": (lambda: build("llama", num_key_value_heads=1), LLAMA_PLAN),
        "norm_of_heads": (qwen3, LLAMA_PLAN),
        "column_alone": (TPNet, {"*.up": "column"}),
        "row_alone": (TPNet, {"*.down": "row"}),
        "row_first": (lambda: build_model("tiny"), {**GPT_PLAN, "blocks.*.mlp.c_fc": "row",
                                                    "blocks.*.mlp.c_proj": "column"}),
    }
    errors = {}
    for case, (make, plan) in cases.items():
        torch.manual_seed(0)
        module = make()
        comm.stats.reset()
        try:
            TensorParallel(module, plan)
            errors[case] = None
        except ValueError as e:
            errors[case] = str(e)
        errors[f"{case} sent"] = sum(comm.stats.calls.values())
    return errors
