"""Model-state memory and communication per rank, without allocating the model.

    python -m tiny_zero.measure.estimate --model gpt2-xl --strategy zero3 --world-size 64 [--mixed-precision bf16]

Two estimates, side by side. The ZeRO formula (Rajbhandari et al., 2020), for
Ψ parameters on N ranks, P bytes per parameter and per gradient (4 in fp32,
2 in bf16/fp16) and K bytes of optimizer state per parameter (AdamW: 8 for
the two fp32 moments, 12 under mixed precision with the fp32 master):

    ddp          PΨ + PΨ + KΨ
    zero1        PΨ + PΨ + KΨ/N     (the full gradients stay, as in the paper)
    zero2        PΨ + (P + K)Ψ/N
    zero3, fsdp  (2P + K)Ψ/N
    offload      PΨ + (P + 12)Ψ/N   (zero2's, with the fp32 masters apart from the
                                     parameters in fp32 too; all but PΨ in host memory)

And what tiny_zero's wrappers allocate, from the code that partitions: the
buckets of zero1/2 padded to N at the default bucket size, zero3's owner
table (whole tensors, so ranks differ: the mean and the most-loaded rank,
which holds at least the largest tensor), fsdp's per-layer units padded to N. Step counts are
Python ints (under fp16 one fp32 per parameter on the device, a few bytes left out). This is what a rank holds after a step, before
zero_grad(): activations, buckets in flight and gathered parameters come on
top (tiny_zero.measure.memory measures those). placement() splits it by
where it lives: offload keeps all but its parameters in host memory, with
the pinned copy of its chunks in the parameter dtype (PΨ/N under bf16 or
fp16) that goes back to the device after each step.

Communication per step is the collectives each strategy issues, by size (the
whole buffer, as tiny_zero.comm counts them), for a model whose every layer
runs once in forward and once in backward. A rank sends and receives about
(N-1)/N of each (twice that for an all-reduce), so per rank the ZeRO paper's
volumes are ddp and zero1/2 2Ψ(N-1)/N, zero3 and fsdp 3Ψ(N-1)/N. A tied
weight is gathered once per layer that uses it, so a GPT's zero3/fsdp traffic
is a little over 3Ψ. One scalar all-reduce per step (the gradient norm) is left out.

Activations (context_activations): what a rank of the example GPT saves for
backward in one forward, which context parallelism over C ranks divides by C.
"""
import argparse
import sys

import torch

from ..buckets import DEFAULT_BUCKET_BYTES, make_buckets
from ..units import find_units
from ..fsdp.wrapper import flat_units
from ..module import hooked_modules, layer_kind
from ..zero3.wrapper import loads, owner_table, unit_params
from ..precision import param_dtype
from ..tensor.wrapper import planned_linears, split_parameters

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "offload")
CATEGORIES = ("parameters", "gradients", "optimizer_state")  # model state, as tiny_zero.measure.memory names it


def formula_terms(strategy, mixed_precision=None):
    """The ZeRO formula's terms: {category: (bytes per parameter, divided by N)}.
    strategy: one of STRATEGIES, or "single" (one device: the same as ddp)."""
    p, k = element_bytes(mixed_precision, strategy)
    sharded = {"single": (), "ddp": (), "zero1": ("optimizer_state",),
               "zero2": ("gradients", "optimizer_state"), "offload": ("gradients", "optimizer_state"),
               "zero3": CATEGORIES, "fsdp": CATEGORIES}[strategy]
    return {c: (size, c in sharded) for c, size in zip(CATEGORIES, (p, p, k))}


def zero_formula(strategy, numel, world_size, mixed_precision=None):
    """Bytes per rank by the ZeRO formula: {parameters, gradients, optimizer_state}."""
    return {c: numel * size / (world_size if sharded else 1)
            for c, (size, sharded) in formula_terms(strategy, mixed_precision).items()}


def term_text(size, sharded):
    return f"{size}Ψ/N" if sharded else f"{size}Ψ"


def formula_text(strategy, mixed_precision=None):
    """The formula as text: '4Ψ + 4Ψ + 8Ψ/N', '16Ψ/N'."""
    terms = formula_terms(strategy, mixed_precision).values()
    if all(sharded for _, sharded in terms):
        return term_text(sum(size for size, _ in terms), True)
    return " + ".join(term_text(*t) for t in terms)


def comm_theory(strategy, numel, world_size):
    """The ZeRO paper's element-transfers per rank per step: 2Ψ or 3Ψ, times (N-1)/N."""
    if strategy == "single":
        return 0
    return (3 if strategy in ("zero3", "fsdp") else 2) * numel * (world_size - 1) / world_size


def transfers_per_rank(elements, world_size):
    """Element-transfers per rank for {collective kind: elements}: (N-1)/N of
    each collective's size, twice that for an all-reduce (reduce-scatter + all-gather)."""
    share = (world_size - 1) / world_size
    return sum(count * share * (2 if kind == "all_reduce" else 1) for kind, count in elements.items())


def model_state(module, strategy, world_size, mixed_precision=None, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """Per rank (a list of N dicts), the bytes of {parameters, gradients,
    optimizer_state} that tiny_zero's `strategy` holds after a step, for
    `module` (build it on the meta device: nothing is allocated)."""
    p, k = element_bytes(mixed_precision, strategy)
    params = [param for _, param in module.named_parameters()]  # a tied parameter once
    numel = sum(param.numel() for param in params)
    n = world_size
    if strategy == "ddp":  # elements of params, grads, optimizer state
        held = [(numel, numel, numel)] * n
    elif strategy in ("zero1", "zero2", "offload"):
        buckets = make_buckets(as_dtype(params[::-1], mixed_precision), bucket_bytes, pad_to=n)
        total = sum(b.numel for b in buckets)
        grads = total if strategy == "zero1" else total // n  # zero1: the full local grads (the shard's average in them)
        held = [(total, grads, total // n)] * n
    elif strategy == "zero3":
        named = [(name, param.numel()) for name, param in module.named_parameters()]
        held = [(load, load, load) for load in loads(owner_table(named, n), named, n)]
    elif strategy == "fsdp":
        share = sum(u.numel for u in fsdp_units(module, n)) // n
        held = [(share, share, share)] * n
    else:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    return [dict(parameters=a * p, gradients=g * p, optimizer_state=s * k) for a, g, s in held]


def placement(module, strategy, world_size, mixed_precision=None, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """Per rank, {"device": bytes, "host": bytes} of what model_state() counts,
    with offload's pinned parameter-dtype copy of its chunks (under bf16 or
    fp16) on the host; the other strategies keep everything on their device."""
    ranks = model_state(module, strategy, world_size, mixed_precision, bucket_bytes)
    if strategy != "offload":
        return [{"device": sum(r.values()), "host": 0} for r in ranks]
    p, _ = element_bytes(mixed_precision)
    return [{"device": r["parameters"], "host": r["gradients"] + r["optimizer_state"]
             + (r["gradients"] if p != 4 else 0)}  # the copy back: the share, in the parameter dtype
            for r in ranks]


def comm_per_step(module, strategy, world_size, mixed_precision=None, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """{collective kind: elements} that `strategy` sends in one step (as tiny_zero.comm counts),
    the buffers' broadcast at the forward's start (BatchNorm's statistics) among them."""
    sent = strategy_comm(module, strategy, world_size, mixed_precision, bucket_bytes)
    buffers = sum(b.numel() for b in module.buffers())
    if buffers and world_size > 1:
        sent["broadcast"] = sent.get("broadcast", 0) + buffers
    return sent


def strategy_comm(module, strategy, world_size, mixed_precision, bucket_bytes):
    """comm_per_step's collectives of the grads and parameters."""
    params = [param for _, param in module.named_parameters()]
    numel = sum(param.numel() for param in params)
    if strategy == "ddp":  # one flat buffer, all-reduced bucket by bucket
        return {"all_reduce": numel}
    if strategy in ("zero1", "zero2", "offload"):  # grads reduce-scattered, updated params all-gathered
        buckets = make_buckets(as_dtype(params[::-1], mixed_precision), bucket_bytes, pad_to=world_size)
        padded = sum(b.numel for b in buckets)
        return {"reduce_scatter": padded, "all_gather": padded}
    if strategy == "zero3":  # each unit's tensors broadcast, once per run of layers using it, forward and backward
        params_of = unit_params(find_units(module, layers(module), None))
        size = lambda unit: sum(p.numel() for p in params_of[unit])  # noqa: E731
        return {"broadcast": 2 * gathered(layers(module), params_of, size), "reduce": numel}
    if strategy == "fsdp":  # each unit all-gathered, the same way
        units = fsdp_units(module, world_size)
        by_unit = {u: u.params for u in units}
        return {"all_gather": 2 * gathered(layers(module), by_unit, lambda u: u.numel),
                "reduce_scatter": sum(u.numel for u in units)}
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def tensor_comm_per_step(module, plan, tp_size, replicas, tokens):
    """{collective kind: elements} that tensor parallelism (tiny_zero.tensor)
    sends in one step on `tokens` tokens per replica, every layer running once
    in forward and once in backward: in a tensor group, all-reduces of each row
    Linear's output in forward (tokens x its output features) and of each
    column Linear's input grad in backward (tokens x its input features;
    column Linears that read one input, as separate q, k and v do, send one
    all-reduce for all: count one of them); across the replicas, the grads a
    rank holds (its slices, the rest whole)."""
    planned = planned_linears(module, plan, tp_size, tp_size * replicas)
    activations = sum(tokens * (layer.in_features if kind == "column" else layer.out_features)
                      for layer, (kind, _) in planned.items())
    split = split_parameters(planned)
    held = sum(p.numel() // (tp_size if p in split else 1) for p in module.parameters() if p.requires_grad)
    return {"all_reduce": activations + (held if replicas > 1 else 0)}


def context_comm_per_step(module, method, cp_size, replicas, rows, tokens):
    """{collective kind: elements} that context parallelism (tiny_zero.context)
    sends in one step of `rows` sequences of `tokens` per replica, every
    attention running once in forward and once in backward. Ring: k and v
    (rows x tokens/C x kv width, together) go to the next rank C-1 times in
    forward, C-1 times in backward with their grads C times. Ulysses: q, k, v
    and the output go through an all-to-all in forward, and again in backward.
    Then the loss's all-reduce (one number) and ddp's of the grads."""
    layers, width, kv_width = attention_shapes(module)
    share = rows * tokens // cp_size
    sent = {}
    if cp_size > 1 and method == "ring":
        kv = 2 * share * kv_width
        sent = {"send": layers * kv * (3 * cp_size - 2), "recv": layers * kv * (3 * cp_size - 2)}
    elif cp_size > 1:
        sent = {"all_to_all": layers * 2 * share * (2 * width + 2 * kv_width)}
    held = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {**sent, "all_reduce": 1 + (held if cp_size * replicas > 1 else 0)}


def attention_shapes(module):
    """(attention layers, query width, key/value width) from the config of the
    example GPT or Llama, or of a Hugging Face decoder."""
    config = module.config
    layers = getattr(config, "n_layer", None) or config.num_hidden_layers
    width = getattr(config, "n_embd", None) or config.hidden_size
    heads = getattr(config, "n_head", None) or config.num_attention_heads
    kv_heads = getattr(config, "n_kv_head", None) or getattr(config, "num_key_value_heads", None) or heads
    return layers, width, width // heads * kv_heads


def context_activations(module, rows, tokens, cp_size=1, split_attention=True):
    """Bytes of the activations one rank holds at the end of a training
    forward of the example GPT (the tensors autograd saves for backward, in
    fp32, dropout 0): `rows` sequences of `tokens`, each rank holding
    tokens/C of every activation under context parallelism of size C. Per
    token, for L blocks of width d with H heads and a vocabulary of V, in
    4-byte elements:

        a block    16d + H + 4: its input and the residual after attention
                   (d each), the two LayerNorms' outputs (d each) and their
                   mean and 1/std (2 each), q, k, v (3d), attention's output
                   (d) and log-sum-exp (H), the MLP's 4d hidden before and
                   after the GELU (8d); and d more where attention is split
                   (split_attention: ring and Ulysses return heads first, and
                   c_proj keeps the token-major copy; torch's attention
                   returns it token-major)
        the head   2d + 2 + V: ln_f's input, output and statistics, the log-softmax

    plus the token ids and the targets (int64, 16 bytes a token) and the
    positions (int64, one row). The loss's scalars are left out (a few
    bytes). Under --mixed-precision the bf16/fp16 tensors take half: this is
    then an upper bound. The peak of a step, in backward, holds what is still
    saved then (tiny_zero.measure.memory's activations at the peak), less."""
    config = module.config
    if hasattr(config, "n_kv_head") or not hasattr(config, "n_embd"):
        raise ValueError("context_activations counts the example GPT's tensors (example/model.py: GPT) only")
    if tokens % cp_size:
        raise ValueError(f"{tokens} tokens do not split over {cp_size} ranks")
    d, share = config.n_embd, tokens // cp_size
    block = 16 * d + config.n_head + 4 + (d if split_attention else 0)
    per_token = 4 * (config.n_layer * block + 2 * d + 2 + config.vocab_size) + 16
    return rows * share * per_token + 8 * share


def moe_blocks(module):
    """(experts, width, top_k) of each sparse MoE block: a module with a top_k
    whose `experts` holds 3-D tensors (Mixtral's, example/model.py's MoE)."""
    return [(tensors[0].shape[0], min(tensors[0].shape[1:]), block.top_k)
            for block, tensors in expert_tensors(module)]


def expert_tensors(module):
    """[(block, its 3-D expert tensors)] of each sparse MoE block of module."""
    found = []
    for block in module.modules():
        experts = getattr(block, "experts", None)
        tensors = [p for p in experts.parameters() if p.dim() == 3] if isinstance(experts, torch.nn.Module) else []
        if tensors and hasattr(block, "top_k"):
            found.append((block, tensors))
    return found


def expert_state(module, ep_size):
    """Bytes of the experts one rank holds under expert parallelism over
    ep_size ranks (tiny_zero.experts): E/P of each MoE block's experts,
    whole, in fp32, with their grads and AdamW's two moments (16 bytes an
    element). It falls as 1/P; the rest of the model is held as its
    data-parallel strategy holds it."""
    numel = sum(p.numel() for _, tensors in expert_tensors(module) for p in tensors)
    return 16 * numel // ep_size


def experts_comm_per_step(module, rows, tokens):
    """{"all_to_all": elements} one rank sends per step under expert
    parallelism, on average over the ranks (each counts what it sends, as
    tiny_zero.comm does): per MoE layer, its E counts, then each of its
    rows x tokens tokens' top_k picks (width d) dispatched and combined, in
    forward, and both again in backward. The ranks' sum is exact whatever the
    routing: every pick is sent once each way."""
    picks = rows * tokens
    return {"all_to_all": sum(experts + 4 * picks * top_k * width for experts, width, top_k in moe_blocks(module))}


def element_bytes(mixed_precision=None, strategy=None):
    """(P, K): bytes per parameter (and per gradient), and of AdamW state per parameter."""
    p = torch.finfo(param_dtype(mixed_precision)).bits // 8
    if strategy == "offload":
        return p, 12  # the fp32 master is on the host, apart from the parameters, in fp32 too
    return p, 8 if p == 4 else 12  # mixed precision adds the fp32 master


def as_dtype(params, mixed_precision):
    """Meta stand-ins in the parameter dtype: the wrappers convert the model
    before they cut buckets, and a bucket's capacity is in bytes."""
    dtype = param_dtype(mixed_precision)
    return [torch.empty(q.shape, dtype=dtype, device="meta") for q in params]


def gathered(module_layers, params_of, size):
    """Elements one pass gathers: each unit once per run of consecutive layers
    (in module order, the forward order of the example models) that use it.
    `size(unit)`: its elements (its parameters', or its padded flat layout's)."""
    unit_of = {p: unit for unit, params in params_of.items() for p in params}
    needed = [unit for layer in module_layers for unit in dict.fromkeys(unit_of[p] for p in layer.parameters(recurse=False))]
    runs = [u for i, u in enumerate(needed) if i == 0 or needed[i - 1] is not u]
    return sum(size(u) for u in runs)


def fsdp_units(module, world_size):
    """fsdp's flat units for `module`: its blocks (the default), each other layer alone."""
    return flat_units(find_units(module, layers(module), None), world_size)


def layers(module):
    """What holds parameters for a strategy, in module order: the layers
    tiny_zero converts, and for each module reached through hooks
    (tiny_zero/hooked.py) the parameters it owns (Hooked)."""
    hooked = {id(m): Hooked(m, owned) for _, m, owned in hooked_modules(module)}
    inside = {id(inner) for m in hooked.values() if m.module is not module for inner in m.module.modules()}
    found = []
    for m in module.modules():
        if id(m) in hooked:
            found.append(hooked[id(m)])
        elif layer_kind(m) is not None and id(m) not in inside and any(True for _ in m.parameters(recurse=False)):
            found.append(m)
    return found


class Hooked:
    """A module reached through hooks, as the estimate sees it: the module and the parameters it owns."""

    def __init__(self, module, owned):
        self.module, self.params = module, list({id(p): p for _, _, p in owned}.values())

    def parameters(self, recurse=False):
        return iter(self.params)


def fmt_bytes(n):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def report(module, model_name, strategy, world_size, mixed_precision=None, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """The CLI's text for one strategy."""
    numel = sum(p.numel() for p in module.parameters())
    n = world_size
    precision = mixed_precision or "fp32"
    lines = [f"{model_name}, {strategy} on {n} ranks, {precision}: Ψ = {numel:,} parameters"]
    row = "  {:<40} {:>11} {:>11} {:>11} {:>11} {:>10}"
    lines.append(row.format("model state per rank", "parameters", "gradients", "optimizer", "total", "x formula"))
    formula = zero_formula(strategy, numel, n, mixed_precision)

    def add(label, held):
        parts = [held["parameters"], held["gradients"], held["optimizer_state"]]
        ratio = sum(parts) / sum(formula.values())
        lines.append(row.format(label, *map(fmt_bytes, parts + [sum(parts)]), f"{ratio:.4f}"))

    add(f"ZeRO formula {formula_text(strategy, mixed_precision)}", formula)
    ranks = model_state(module, strategy, n, mixed_precision, bucket_bytes)
    if strategy == "zero3":
        mean = {key: sum(r[key] for r in ranks) / n for key in ranks[0]}
        most = max(range(n), key=lambda r: sum(ranks[r].values()))
        add("tiny_zero owner table, mean", mean)
        add(f"tiny_zero owner table, rank {most} (most)", ranks[most])
    else:
        padding = {"zero1": f", {fmt_bytes(bucket_bytes)} buckets padded",
                   "zero2": f", {fmt_bytes(bucket_bytes)} buckets padded",
                   "offload": f", {fmt_bytes(bucket_bytes)} buckets padded",
                   "fsdp": ", per-layer units padded"}.get(strategy, "")
        add(f"tiny_zero{padding}", ranks[0])
    if strategy == "offload":
        where = placement(module, strategy, n, mixed_precision, bucket_bytes)[0]
        copy = " + the pinned copy back" if element_bytes(mixed_precision)[0] != 4 else ""
        lines.append(f"  on the device {fmt_bytes(where['device'])} (the parameters); in host memory "
                     f"{fmt_bytes(where['host'])} (grads, fp32 masters, AdamW state{copy})")

    elements = comm_per_step(module, strategy, n, mixed_precision, bucket_bytes)
    p, _ = element_bytes(mixed_precision)
    lines.append("  communication per step (the size of each kind of collective, summed; as tiny_zero.comm counts)")
    for kind, count in elements.items():
        lines.append(f"    {kind:<16} {count:>16,} elements {fmt_bytes(count * p):>12}")
    sent, theory = transfers_per_rank(elements, n), comm_theory(strategy, numel, n)
    lines.append(f"    per rank: {sent:,.0f} element-transfers = {sent / numel:.3f}Ψ "
                 f"(ZeRO: {3 if strategy in ('zero3', 'fsdp') else 2}Ψ(N-1)/N = {theory:,.0f}; "
                 f"(N-1)/N = {(n - 1) / n:.3f})")
    return "\n".join(lines)


def build_meta(name):
    try:
        from example.model import CONFIGS, build_model
    except ImportError:
        raise SystemExit("error: the example models (example/model.py) are importable only from a "
                         "checkout: run this from the repository root") from None
    if name not in CONFIGS:
        raise SystemExit(f"error: unknown model {name!r}; choose from {', '.join(CONFIGS)}")
    return build_model(name, device="meta")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tiny_zero.measure.estimate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2", help="a config name of example/model.py (default: gpt2)")
    p.add_argument("--strategy", choices=STRATEGIES, nargs="+", default=list(STRATEGIES),
                   help="one or more (default: all)")
    p.add_argument("--world-size", type=int, default=8, help="ranks N (default: 8)")
    p.add_argument("--mixed-precision", choices=["bf16", "fp16"], default=None,
                   help="bf16/fp16 parameters and grads, fp32 masters and AdamW state (default: fp32)")
    p.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20,
                   help="bucket size in MiB (default: the wrappers' 25)")
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    bucket_bytes = int(args.bucket_mb * 2**20)
    module = build_meta(args.model)
    print("\n\n".join(report(module, args.model, s, args.world_size, args.mixed_precision, bucket_bytes)
                      for s in args.strategy))


if __name__ == "__main__":
    sys.exit(main())
