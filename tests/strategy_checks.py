"""Worker functions for the strategy tests that are not plain parity: memory,
communication volume, nothing left gathered, meta init, bad input."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tiny_zero
from tiny_zero import comm
from tiny_zero.measure.memory import TensorMemory
from parity_checks import PER_RANK, global_batch, wrap
from example.model import build_model

FLOAT_BYTES = 4


class ChainNet(nn.Module):
    """No tied weights, every layer used once: each parameter is gathered
    exactly twice per step (forward, backward)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 10)
        self.ln = nn.LayerNorm(10)
        self.fc = nn.Linear(10, 7)
        self.head = nn.Linear(7, 13, bias=False)

    def forward(self, idx, targets):
        logits = self.head(torch.tanh(self.fc(self.ln(self.emb(idx)))))
        return F.cross_entropy(logits.view(-1, 13), targets.reshape(-1))


def my_batch(step=0):
    rank, world = dist.get_rank(), dist.get_world_size()
    return [t[rank * PER_RANK:(rank + 1) * PER_RANK] for t in global_batch(step, 0, world)]


def comm_per_step(name):
    """Elements each kind of collective moves in one step, and Ψ (and Ψ padded)."""
    torch.manual_seed(0)
    model = wrap(name, ChainNet())
    opt = tiny_zero.STRATEGIES[name][1](model, lr=1e-2)
    comm.stats.reset()
    model.backward(model(*my_batch()))
    opt.step()
    numel = sum(p.numel() for p in ChainNet().parameters())
    padded = sum(b.numel for b in model.buckets) if name != "zero3" else numel
    return dict(comm.stats.elements), numel, padded


def gpt_tiny():
    return build_model("tiny", seed=0)


def nothing_stays_gathered(name):
    """zero3: non-owners hold no full parameter after forward or backward.
    fsdp: the same for every rank, at most two layers' units (the one
    computing and the one prefetched) are ever gathered at once, and the
    averaged grads of a unit exist only from its reduce-scatter on: after
    each, model.grads holds the units sent so far, no more."""
    torch.manual_seed(0)
    model = wrap(name, gpt_tiny())
    opt = tiny_zero.STRATEGIES[name][1](model, lr=1e-3)
    x, y = global_batch_tokens()
    most = {"layers": 0}
    problems = []

    if name == "fsdp":  # after each layer's gathers: the layer about to compute, and any started ahead
        wait_for, send_bucket = model.wait_for, model.send_bucket
        sent = []

        def counted_wait_for(units):
            wait_for(units)
            most["layers"] = max(most["layers"], 1 + len(model.prefetched))

        def grads_follow_the_units(unit):
            sent.append(unit)
            send_bucket(unit)
            held = sum(g.numel() for g in model.grads.values())
            if held != sum(model.slices[u].numel() for u in set(sent)):
                problems.append(f"after {len(sent)} reduce-scatters model.grads holds {held} elements")
        model.wait_for = counted_wait_for
        model.send_bucket = grads_follow_the_units  # in backward; at its end
        model.clear_grads = lambda set_to_none, clear=model.clear_grads: (clear(set_to_none), sent.clear())
    for step in range(3):
        loss = model(x, y)
        problems += held_full(model, name, f"step {step} after forward")
        model.backward(loss)
        problems += held_full(model, name, f"step {step} after backward")
        opt.step()
        opt.zero_grad()
    if name == "fsdp" and most["layers"] > 2:
        problems.append(f"{most['layers']} layers gathered at once (at most 2: current + prefetched)")
    return problems


def grads_freed_one_send_later(name):
    """zero2, zero3, fsdp, offload send each bucket as its grads are final,
    and free its full grads when the next send starts (Wrapper.queue_finish): after
    every send, of the buckets sent in this backward, at most the one in
    flight still holds its grads; none once backward ends."""
    torch.manual_seed(0)
    model = wrap(name, gpt_tiny())
    opt = tiny_zero.STRATEGIES[name][1](model, lr=1e-3)
    x, y = global_batch_tokens()
    sent, problems = [], []
    finish_after = model.queue_finish

    def counted(bucket, *rest):
        finish_after(bucket, *rest)
        sent.append(bucket)
        held = sum(b.grads is not None for b in sent)
        if held > 1:
            problems.append(f"{name}: after {len(sent)} sends {held} sent buckets still hold their grads")
    model.queue_finish = counted
    for step in range(2):
        sent.clear()
        model.backward(model(x, y))
        if not sent or any(b.grads is not None for b in sent):
            problems.append(f"{name} step {step}: {len(sent)} sends, grads held after backward")
        opt.step()
        opt.zero_grad()
    return problems


def global_batch_tokens():
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2 * world, 33), generator=g)[2 * rank:2 * rank + 2]
    return tokens[:, :-1], tokens[:, 1:]


def held_full(model, name, when):
    bad = []
    for pname, p in model.named_params:
        owned = name == "zero3" and model.owner[p] == dist.get_rank()
        held = p.untyped_storage().nbytes() // p.element_size()
        if not owned and held > 1:  # released: one shared zero, expanded
            bad.append(f"rank {dist.get_rank()} {when}: {pname} still holds {held} elements")
    return bad


def model_state_bytes(name):
    """After one step: bytes of params + grads + optimizer state held by this
    rank, against the strategy's share: zero3 16 x (elements owned); fsdp and
    zero1/2 the ZeRO formula with padding."""
    torch.manual_seed(0)
    with TensorMemory() as memory:
        model = wrap(name, gpt_tiny(), bucket_bytes=64 * 1024)
        opt = tiny_zero.STRATEGIES[name][1](model, lr=1e-3)
        x, y = global_batch_tokens()
        before_forward = memory.current
        loss = model(x, y)
        model.backward(loss)
        del loss
        after_backward = memory.current - before_forward
        opt.step()
        held = memory.settle()  # gloo's thread may still hold a finished collective's buffer
    rank, world = dist.get_rank(), dist.get_world_size()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.numel() > 1)
    numel = sum(p.numel() for p in gpt_tiny().parameters())
    share = sum(s.numel() for s in model.shards)  # what this rank steps
    if name in ("zero3", "fsdp"):  # params, averaged grads, exp_avg, exp_avg_sq of the share
        expected = 16 * share
    elif name == "offload":  # all params; on the host the grad shard, fp32 masters, exp_avg, exp_avg_sq
        expected = share * world * FLOAT_BYTES + share * FLOAT_BYTES + 12 * share
    else:  # all params and a grad shard; zero1 all local grads instead, kept, its own chunks then averaged
        grads = share * world * FLOAT_BYTES if name == "zero1" else share * FLOAT_BYTES
        expected = share * world * FLOAT_BYTES + grads + 8 * share
    biggest_bucket = max(b.numel for b in model.buckets) * FLOAT_BYTES
    return dict(held=held, expected=expected, state=state, share=share, numel=numel,
                after_backward=after_backward, biggest_bucket=biggest_bucket)


def meta_init_equals_normal(name):
    """A model built on meta and wrapped equals the normally built one, exactly."""
    normal = gpt_tiny().state_dict()
    with torch.device("meta"):
        module = build_model("tiny", seed=0)
    model = wrap(name, module)
    full = model.full_state_dict()
    return [k for k, v in normal.items() if not torch.equal(full[k], v)] + \
           [k for k in full if k not in normal]


def bad_input(case):
    """Every rank must raise a clear error (and nobody hang)."""
    rank = dist.get_rank()
    try:
        if case == "meta_on_one_rank":  # zero3 would wait for a broadcast of values rank 1 does not have
            with torch.device("meta" if rank == 1 else "cpu"):
                module = nn.Sequential(nn.Linear(4, 4))
        elif case == "settings":  # bf16 on rank 1 only: the wrap-time broadcast would mix sizes
            module = nn.Sequential(nn.Linear(4, 4))
            tiny_zero.STRATEGIES["zero3"][0](module, mixed_precision="bf16" if rank == 1 else None)
            return None
        else:  # the model differs across ranks
            module = nn.Sequential(nn.Linear(4, 4 + rank))
        tiny_zero.STRATEGIES["zero3" if case == "meta_on_one_rank" else "zero2"][0](module)
    except (TypeError, RuntimeError) as e:
        return str(e)
    return None


def gpt2_xl_meta_memory(name, rank, world_size=4):
    """Wrap gpt2-xl built on meta as one rank of a world of 4 (fake process
    group: no peers, no traffic): bytes this rank ever holds, its share, and
    the largest single tensor."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with torch.device("meta"):
            module = build_model("gpt2-xl")
        # This test is about memory: fill with zeros instead of drawing 1.56B
        # random values (meta_init_equals_normal checks the values, on "tiny")
        module.init_parameter = lambda name, tensor: tensor.zero_()
        largest = max(p.numel() for p in module.parameters()) * FLOAT_BYTES
        with TensorMemory() as memory:
            model = wrap(name, module)
            # owned tensors (zero3) or each unit's slice (fsdp); grads come with the first backward
            share = sum(s.numel() for s in model.shards) * FLOAT_BYTES
        return dict(peak=memory.peak, current=memory.current, share=share, largest=largest)
    finally:
        dist.destroy_process_group()


def pieces_cover_the_model(name):
    """model.pieces() on every rank together cover every element of every
    parameter exactly once (ddp: every rank covers everything), with the
    values of the full model."""
    from parity_checks import ParityNet
    torch.manual_seed(0)
    model = wrap(name, ParityNet())
    full = model.full_state_dict()
    covered = {n: torch.zeros(p.numel(), dtype=torch.int32) for n, p in ParityNet().named_parameters()}
    wrong = []
    for piece in model.pieces():
        covered[piece.name][piece.lo:piece.hi] += 1
        held = piece.tensor.detach().reshape(-1)[piece.offset:piece.offset + piece.hi - piece.lo]
        if not torch.equal(held, full[piece.name].reshape(-1)[piece.lo:piece.hi]):
            wrong.append(f"{name} rank {dist.get_rank()}: {piece.name}[{piece.lo}:{piece.hi}] holds other values")
    counts = {n: c for n, c in covered.items()}
    for c in counts.values():
        dist.all_reduce(c)
    expect = dist.get_world_size() if name == "ddp" else 1
    wrong += [f"{name}: {n} covered {c.min().item()}..{c.max().item()} times" for n, c in counts.items()
              if not bool((c == expect).all())]
    return wrong


def pieces_cover_all(names):
    return [p for name in names for p in pieces_cover_the_model(name)]

