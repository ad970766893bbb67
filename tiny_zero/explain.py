"""What a DeepSpeed config does in tiny_zero: the strategy, the bytes, the collectives, the keys.

    python -m tiny_zero.explain ds_config.json --model gpt2 --world 8
    python -m tiny_zero.explain ds_config.json --model hf:path/to/model --world 64

The bytes and the elements sent come from tiny_zero.measure.estimate (its
model_state, placement and comm_per_step, which tests/test_estimate.py checks
against what the wrappers allocate and send); the number of each collective
is the number of buckets or units that the same partitioning makes.
"""
import argparse
import importlib.util
import sys
from collections import Counter
from pathlib import Path

import torch

from .buckets import make_buckets
from .config import read_config
from .materialize import meta_parameters
from .measure import estimate

GRAD_COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce")  # in the reduce dtype; the others in the parameters'


def build_module(name):
    """An example model (example/model.py) or hf:DIR (a Hugging Face config), on the meta device."""
    if name.startswith("hf:"):
        return build_hf(name[3:])
    checkout = Path(__file__).resolve().parents[1]  # example/ sits beside tiny_zero/ in a checkout
    if importlib.util.find_spec("example") is None and (checkout / "example").is_dir():
        sys.path.append(str(checkout))  # run from another directory (or tiny_zero installed from the checkout)
    return estimate.build_meta(name)


def build_hf(directory):
    """The model that save_pretrained wrote in `directory`, from its config.json alone, on the meta device:
    any vocabulary (only the examples, which feed bytes, need 256 tokens). transformers is needed here,
    for its model classes; tiny_zero's wrappers never import it."""
    if not (Path(directory) / "config.json").is_file():
        raise ValueError(f"--model hf:{directory}: no config.json there (a directory save_pretrained wrote)")
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise SystemExit('error: --model hf:DIR needs transformers (pip install -e ".[hf]")') from None
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    with meta_parameters():
        return transformers.AutoModelForCausalLM.from_config(config)


def collective_counts(module, strategy, world_size, mixed_precision, bucket_bytes):
    """{collective kind: how many are sent in one step}: one per bucket or unit, as the wrappers send them;
    and the buffers' broadcast at the forward's start, one per dtype (BatchNorm's statistics)."""
    counts = grad_and_param_counts(module, strategy, world_size, mixed_precision, bucket_bytes)
    dtypes = {b.dtype for b in module.buffers()}
    if dtypes and world_size > 1:
        counts["broadcast"] = counts.get("broadcast", 0) + len(dtypes)
    return counts


def grad_and_param_counts(module, strategy, world_size, mixed_precision, bucket_bytes):
    """collective_counts' collectives of the grads and parameters."""
    if strategy == "fsdp":
        units = estimate.fsdp_units(module, world_size)
        gathers = estimate.gathered(estimate.layers(module), {u: u.params for u in units}, lambda unit: 1)
        return {"all_gather": 2 * gathers, "reduce_scatter": sum(1 for u in units if u.params[0].requires_grad)}
    params = [p for _, p in module.named_parameters()]
    buckets = len(make_buckets(estimate.as_dtype(params[::-1], mixed_precision), bucket_bytes, pad_to=world_size))
    if strategy == "ddp":
        return {"all_reduce": buckets}
    return {"reduce_scatter": buckets, "all_gather": buckets}


def size(n):
    return f"{n:,} B ({estimate.fmt_bytes(n)})"


def held_lines(module, c):
    """What each rank holds after a step, by the estimator."""
    bucket_bytes = c.bucket_bytes() if c.bucket_elements is not None else estimate.DEFAULT_BUCKET_BYTES
    ranks = estimate.model_state(module, c.strategy, c.world_size, c.mixed_precision, bucket_bytes)
    held = ranks[0]
    _, k = estimate.element_bytes(c.mixed_precision, c.strategy)
    elements = held["optimizer_state"] // k
    masters = 4 * elements if k == 12 else 0
    lines = ["what each rank holds after a step (tiny_zero.measure.estimate.model_state):",
             f"  parameters        {size(held['parameters'])}",
             f"  gradients         {size(held['gradients'])}",
             f"  optimizer state   {size(held['optimizer_state'])}: exp_avg+exp_avg_sq {size(8 * elements)}, "
             f"fp32 masters {size(masters)}",
             f"  total             {size(sum(held.values()))}"]
    if c.strategy == "offload":
        where = estimate.placement(module, c.strategy, c.world_size, c.mixed_precision, bucket_bytes)[0]
        lines.append(f"  on the device {size(where['device'])}; in host memory {size(where['host'])}")
    elif c.offload_optimizer:  # stage 3 (FSDPOffload): fsdp's slices, with their optimizer on the host
        host = held["gradients"] + held["optimizer_state"] + held["parameters"]  # the slices, or the step's copy of them
        device = 0 if c.offload_params else held["parameters"]  # offload_param: the slices live on the host
        what = ("the parameter slices, their grads and optimizer state" if c.offload_params else
                "the grads, the optimizer state and a copy of the parameter slices, which the step writes")
        lines.append(f"  on the device {size(device)}; in host memory {size(host)} ({what})")
    if c.accumulation > 1:
        lines.append(accumulation_line(module, c, held["gradients"]))
    return lines, bucket_bytes


def accumulation_line(module, c, shard):
    """The grads a rank holds between micro-steps: its shard at stages 2 and 3 (each micro-step
    reduce-scatters into it), the whole model's at stages 0 and 1 (reduced at the boundary)."""
    if c.stage >= 2:
        return (f"  between micro-steps the grads stay in the shard, {size(shard)}: every micro-step "
                "reduce-scatters into it, as DeepSpeed's stages 2 and 3")
    p, _ = estimate.element_bytes(c.mixed_precision)
    whole = p * sum(q.numel() for q in module.parameters() if q.requires_grad)
    return (f"  between micro-steps the whole model's grads, {size(whole)}: stage {c.stage} averages "
            "them at the boundary, as DeepSpeed's")


def every_micro_step(kind, c):
    """A collective sent at every micro-step, not once a step: fsdp's gathers (forward and backward)
    and, at stages 2 and 3, the grads' reduce-scatter (the engine's backward, as DeepSpeed's)."""
    return (c.strategy == "fsdp" and kind == "all_gather") or (c.stage >= 2 and kind == "reduce_scatter")


def step_collectives(module, c, bucket_bytes):
    """{collective kind: (how many, elements)} in one step of the engine: its micro-steps included."""
    elements = estimate.comm_per_step(module, c.strategy, c.world_size, c.mixed_precision, bucket_bytes)
    counts = collective_counts(module, c.strategy, c.world_size, c.mixed_precision, bucket_bytes)
    times = {kind: c.accumulation if every_micro_step(kind, c) else 1 for kind in elements}
    return {kind: (counts[kind] * times[kind], elements[kind] * times[kind]) for kind in elements}


def sent_lines(module, c, bucket_bytes):
    """What one step sends, by the estimator; how many of each."""
    sent = step_collectives(module, c, bucket_bytes)
    p, _ = estimate.element_bytes(c.mixed_precision)
    reduce_bytes = torch.finfo(c.reduce_dtype).bits // 8 if c.reduce_dtype is not None else p
    lines = [f"what one step of {c.accumulation} micro-step(s) sends (tiny_zero.measure.estimate.comm_per_step; "
             "every layer once forward, once backward, in each micro-step):"]
    for kind, (count, numel) in sent.items():
        width = reduce_bytes if kind in GRAD_COLLECTIVES else p
        lines.append(f"  {kind:<15} x {count:<5} {numel:>16,} elements {numel * width:>16,} B "
                     f"({estimate.fmt_bytes(numel * width)})")
    numel = sum(q.numel() for q in module.parameters())
    per_rank = estimate.transfers_per_rank({kind: n for kind, (_, n) in sent.items()}, c.world_size)
    lines.append(f"  per rank {per_rank / numel:.3f}Ψ element-transfers (Ψ = {numel:,})")
    if c.strategy != "ddp":
        lines.append("  and one scalar all-reduce for the grads' global norm (gradient_clipping, get_global_grad_norm)")
    if c.mixed_precision == "fp16":
        lines.append("  and one scalar all-reduce for fp16's overflow check")
    return lines


def ways_line(module):
    """How the strategy reaches each module that holds parameters: tiny_zero's
    layers, and the modules it reaches through hooks (docs/module.md), by class."""
    found = estimate.layers(module)
    hooked = [m.module for m in found if isinstance(m, estimate.Hooked)]
    own = [m for m in found if not isinstance(m, estimate.Hooked)]

    def by_class(modules):
        counts = Counter(type(m).__name__ for m in modules)
        return ", ".join(f"{name} x{n}" for name, n in counts.items()) or "none"
    return (f"layers: {len(own)} of tiny_zero's ({by_class(own)}); "
            f"{len(hooked)} through module hooks ({by_class(hooked)})")


def explain(config, model, world_size):
    c = read_config(config, world_size)
    module = build_module(model)
    precision = c.mixed_precision or "fp32"
    lines = [f"{config} on {world_size} ranks, model {model}, {precision}",
             f"strategy: tiny_zero.{c.strategy}; read tiny_zero/{c.strategy}/ (wrapper.py, layers.py, optim.py)",
             f"batch: {c.train_batch_size} = {c.micro_batch} per rank x {c.accumulation} micro-steps x {world_size} "
             "ranks", ways_line(module), ""]
    held, bucket_bytes = held_lines(module, c)
    lines += held + [""] + sent_lines(module, c, bucket_bytes) + ["", "keys that set something:"]
    lines += [f"  {key}: {what}" for key, what in c.changed]
    lines += ["keys with no effect here:"] + [f"  {key}: {why}" for key, why in c.no_effect]
    if not c.no_effect:
        lines.append("  (none)")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tiny_zero.explain", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="DeepSpeed's JSON config")
    p.add_argument("--model", default="gpt2", help="a config name of example/model.py, or hf:DIR (default: gpt2)")
    p.add_argument("--world", type=int, default=8, help="ranks (default: 8)")
    args = p.parse_args(argv)
    if args.world < 1:
        p.error("--world must be >= 1")
    try:
        print(explain(args.config, args.model, args.world))
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
