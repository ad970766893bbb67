"""What every example/<strategy>/train.py shares, so that each train.py shows
only its model, its optimizer and the training loop, as nanoGPT's does:

    parse_args, load_data, build_model   flags, the byte-level data, the model:
                                         an example GPT or Llama, or hf:DIR
    load_weights                         hf:DIR: its saved weights, each rank
                                         reading the parts it holds
    param_groups, schedule               AdamW's groups (no decay on 1-D
                                         parameters) and the learning rate:
                                         a linear warm-up, then cosine to lr/10
    Run                                  everything else, one call each: memory
                                         accounting, --resume and --save-every,
                                         --trace (one step recorded),
                                         the batches, the printed lines, a
                                         non-finite loss, eval and the report

On rank 0 a run prints one line per step, `step N loss X` (the loss averaged
over ranks), then the val loss and the peak memory, and (Accounting, at the
end of the file) the memory at the peak by category and the communication per
step, each next to tiny_zero.measure.estimate and the ZeRO formula. Each rank
takes its own rows of one global batch (see example/data.py), so N ranks with
--batch-size b see exactly what one process sees with N * b (under tensor
parallelism the ranks of one replica share its rows).
"""
import argparse
import atexit
import gc
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from example import hf
from example.data import ByteData, load_text
from example.model import CONFIGS, MOE_CONFIGS, build_model as build_example
import tiny_zero
from tiny_zero import comm
from tiny_zero.measure import draw, estimate, trace
from tiny_zero.distributed import uses_cuda
from tiny_zero.measure.memory import TensorMemory
from tiny_zero.context import ContextParallel
from tiny_zero.experts import ExpertSplit
from tiny_zero.pipeline import Pipeline
from tiny_zero.tensor import TensorParallel

# what a script leaves in reference cycles (handles of collectives among them) goes
# while the interpreter is whole: gloo can abort the process when one goes in its teardown
atexit.register(gc.collect)

MAX_GRAD_NORM = 1.0
OTHER_WRAPPERS = {"experts": ExpertSplit, "pipeline": Pipeline, "tensor": TensorParallel,  # not in tiny_zero.STRATEGIES
                  "context": ContextParallel}  # first: each is a DDP (experts: or a Zero1, Zero2)
TRACED_STEP = 2  # --trace records the third step: the first two warm up (optimizer state, the layer order)


def parse_args(description=None, argv=None, add_flags=None):
    """The flags every example takes; add_flags(parser) adds a script's own."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", type=model_name,
                   metavar="{" + ",".join([*CONFIGS, *MOE_CONFIGS, "hf:DIR"]) + "}",
                   help="a model of example/model.py, or hf:DIR, a Hugging Face causal LM saved in the local "
                        "directory DIR (config and weights; needs transformers) (default: small)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step (default: 16)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per sequence (default: 128)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: 1e-3)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps of linear warm-up before the cosine decay (default: a tenth of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay of the 2-D parameters (default: 0.1; none on 1-D ones)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batches (default: 0)")
    p.add_argument("--data", default=None,
                   help="a text file, or a folder of them (default: the Python standard library's source)")
    p.add_argument("--eval-batches", type=int, default=20, help="val batches per rank at the end (default: 20)")
    p.add_argument("--mixed-precision", choices=["bf16", "fp16"], default=None,
                   help="low-precision params, activations and grads; fp32 masters in the optimizer "
                        "(fp16: strategies only, with dynamic loss scaling)")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each block's activations in backward instead of keeping them")
    p.add_argument("--save-dir", default=None, help="checkpoint directory (written at the end, and every --save-every)")
    p.add_argument("--save-every", type=int, default=0, help="save every K steps (default: 0, only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from --save-dir if it holds a checkpoint")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="skip (and count) a step whose loss is inf/nan instead of stopping with an error")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="record the third step (or the last) on every rank: DIR/trace.json for ui.perfetto.dev, "
                        "DIR/trace.png with matplotlib (docs/overlap.md)")
    if add_flags is not None:
        add_flags(p)
    args = p.parse_args(argv)
    if (args.save_every or args.resume) and not args.save_dir:
        p.error("--save-every and --resume need --save-dir")
    for flag in ("steps", "eval_batches", "save_every"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0")
    for flag in ("batch_size", "seq_len"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 10
    if args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    try:
        block_size = hf.block_size(args.model[3:]) if args.model.startswith("hf:") else KNOWN[args.model].block_size
    except ValueError as e:
        p.error(str(e))
    if args.seq_len > block_size:
        p.error(f"--seq-len {args.seq_len} is longer than model {args.model}'s block_size {block_size}")
    args.device = torch.device("cuda" if uses_cuda() else "cpu")  # the wrappers choose alike
    return args


def model_name(value):
    """--model: a name in example/model.py's CONFIGS (or MOE_CONFIGS), or hf:DIR."""
    if value in KNOWN or (value.startswith("hf:") and len(value) > 3):
        return value
    raise argparse.ArgumentTypeError(f"unknown model {value!r}; choose from {', '.join(KNOWN)}, or hf:DIR")


KNOWN = {**CONFIGS, **MOE_CONFIGS}


def load_data(args):
    """The byte-level data, or exit with a one-line error (before any process group exists)."""
    try:
        return ByteData(load_text(args.data), args.seq_len)
    except (OSError, ValueError) as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fails alike: say it once
            print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def build_model(args):
    """The --model: an example model (GPT or Llama), or with hf:DIR a Hugging
    Face model whose parameters are on meta until load_weights() fills them."""
    if args.model.startswith("hf:"):
        return hf.build(args.model[3:], checkpoint_activations=args.checkpoint_activations)
    return build_example(args.model, seed=args.seed, checkpoint_activations=args.checkpoint_activations)


def load_weights(model, args):
    """hf:DIR: the saved weights into the model (a wrapper: each rank reads the
    parts it holds). The example models have theirs from the seed."""
    if args.model.startswith("hf:"):
        tiny_zero.checkpoint.load_pretrained(model, args.model[3:])


def strategy_options(args):
    """What a tiny_zero wrapper takes from the flags."""
    return {"mixed_precision": args.mixed_precision}


def single_device_dtype(args):
    """Single device: bf16 params (tiny_zero's AdamW keeps fp32 masters); fp16
    needs loss scaling, which the strategies' wrappers provide."""
    if args.mixed_precision == "fp16":
        raise SystemExit("error: --mixed-precision fp16 needs loss scaling: run a strategy's "
                         "train.py (e.g. example/ddp/train.py, also on one process)")
    return torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32


def param_groups(module, args):
    """AdamW's groups, as nanoGPT makes them: weight decay on the 2-D
    parameters (matmul weights, embeddings), none on the 1-D ones (biases,
    norms). By shape, which a wrapped model keeps (tiny_zero/step.py)."""
    params = list(module.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def schedule(opt, args):
    """The learning rate: a linear warm-up over --warmup-steps, then a cosine
    decay to a tenth of --lr at the last step (torch.optim.lr_scheduler)."""
    def factor(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


class Run:
    """Everything around a training loop, one call each:

        with Run(args, data) as run:                  # on CPU, counts live tensor bytes from here
            model, opt, sched = ...
            for step in run.steps(model, opt, sched):  # from 0, or the checkpoint (--resume)
                x, y = run.batch(step)
                loss = model(x, y)
                if run.skip(loss, step):               # inf/nan on some rank: skipped, or the run stops
                    continue                           # (the loop's all-reduce of one flag, and a host read)
                ...                                    # backward, clip, step, zero_grad
                run.log(step, loss)                    # the step's line (the loop's all-reduce of the loss,
                                                       # and a host read); saves every --save-every
            run.finish()                               # eval, peak memory, the accounting report
    """

    def __init__(self, args, data):
        self.args, self.data = args, data
        self.memory = TensorMemory() if args.device.type == "cpu" else None  # CUDA keeps its own statistics
        self.skipped = 0

    def __enter__(self):
        if self.memory is not None:
            self.memory.__enter__()
        return self

    def __exit__(self, *exc):
        if self.memory is not None:
            self.memory.__exit__(*exc)
        if dist.is_initialized():
            dist.destroy_process_group()

    def steps(self, model, opt, sched):
        """The steps to run, with a progress bar on rank 0 (the model and
        optimizer are the run's from here on)."""
        self.model, self.opt, self.sched = model, opt, sched
        self.rank = getattr(model, "rank", 0)
        # the data-parallel replica this rank computes: each takes its own rows (every rank, but
        # under tensor parallelism, where the ranks of a replica compute one model together, and
        # under context parallelism, where a context group takes one replica's rows: dp_rank)
        self.replica = getattr(model, "dp_rank", getattr(model, "replica", 0))
        self.replicas = getattr(model, "dp_size", getattr(model, "replicas", 1))
        self.device = getattr(model, "device", None) or next(model.parameters()).device
        first = self.resume()
        self.reset_peak()
        self.accounting = Accounting(model, opt, self.memory, self.args)
        model.train()
        self.bar = tqdm(range(first, self.args.steps), disable=self.rank != 0, desc="train", dynamic_ncols=True,
                        initial=first, total=self.args.steps)
        self.start = self.last = time.perf_counter()
        self.first = first
        self.recorded = None
        return self.traced(self.bar) if self.args.trace else self.bar

    def traced(self, steps):
        """--trace: the same steps; one after warm-up is recorded (tiny_zero.measure.trace)."""
        chosen = min(self.first + TRACED_STEP, self.args.steps - 1)
        for step in steps:
            if step != chosen:
                yield step
                continue
            recorder = trace.Recorder(self.model, self.opt, self.memory)
            recorder.start()
            yield step
            self.recorded = trace.gather(recorder.stop()), step  # written at the end, out of the timing

    def write_trace(self):
        traces, step = self.recorded
        args = self.args
        os.makedirs(args.trace, exist_ok=True)
        path, picture = os.path.join(args.trace, "trace.json"), os.path.join(args.trace, "trace.png")
        title = f"{self.accounting.strategy}, {len(traces)} rank(s), --model {args.model}, step {step}"
        trace.write(path, traces, title)
        print(f"trace of step {step}: {path} (open it in ui.perfetto.dev)")
        print(trace.summary_line(self.accounting.strategy, traces))
        try:
            draw.timeline(traces, picture, title)
            print(f"its picture: {picture}")
        except ImportError:  # matplotlib is the optional extra "plot"
            print(f"for its picture: pip install -e \".[plot]\", then python -m tiny_zero.measure.draw {path}")

    def batch(self, step, split="train"):
        args = self.args
        x, y = self.data.get_batch(split, args.batch_size, step, args.seed, self.replica, self.replicas)
        return x.to(self.device), y.to(self.device)

    def skip(self, loss, step):
        """A loss that is not finite on some rank (one all-reduce, so every rank
        agrees): skipped and counted with --skip-nonfinite, else the run stops."""
        bad = (~torch.isfinite(torch.as_tensor(loss, device=self.device).detach())).float()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad)
        if bad.item() == 0:
            return False
        if not self.args.skip_nonfinite:
            raise SystemExit(f"error: the loss is not finite at step {step} (on some rank); "
                             "--skip-nonfinite skips such steps instead")
        self.skipped += 1
        return True

    def log(self, step, loss):
        mean_loss = loss if isinstance(loss, float) else average_over_ranks(loss.detach())  # a float: the mean already
        now = time.perf_counter()
        if self.rank == 0:
            tokens = self.args.batch_size * self.args.seq_len * self.replicas
            self.bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{tokens / (now - self.last):,.0f}")
            tqdm.write(f"step {step} loss {mean_loss:.8f}")
        self.last = now
        args = self.args
        if args.save_dir and (step + 1 == args.steps or args.save_every and (step + 1) % args.save_every == 0):
            self.save(step + 1)

    def save(self, step):
        """A wrapper saves sharded (tiny_zero.checkpoint: every rank writes its
        part, any strategy and world size can load it); a single-device model
        saves one file. Both replace the old checkpoint only once complete."""
        model, opt, args = self.model, self.opt, self.args
        if hasattr(model, "pieces"):
            tiny_zero.checkpoint.save(args.save_dir, model, opt, step=step,
                                      extra={"schedule": self.sched.state_dict()})
            return
        os.makedirs(args.save_dir, exist_ok=True)
        path = os.path.join(args.save_dir, "single_device.pt")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "schedule": self.sched.state_dict()}, path + ".saving")
        os.replace(path + ".saving", path)

    def resume(self):
        """The step to start from: 0, or the saved one with --resume."""
        model, opt, args = self.model, self.opt, self.args
        if not (args.resume and args.save_dir and os.path.isdir(args.save_dir)):
            return 0
        if hasattr(model, "pieces"):
            info = tiny_zero.checkpoint.load(args.save_dir, model, opt)
            step, schedule_state = info["step"], info["extra"]["schedule"]
        else:
            saved = torch.load(os.path.join(args.save_dir, "single_device.pt"), weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            step, schedule_state = saved["step"], saved["schedule"]
        self.sched.load_state_dict(schedule_state)  # the optimizer's lr came back with its param groups
        if self.rank == 0:
            print(f"resumed from {args.save_dir} at step {step}")
        return step

    def finish(self):
        """Eval, the peak memory, and the accounting report."""
        elapsed = time.perf_counter() - self.start
        self.bar.close()
        args, rank = self.args, self.rank
        self.accounting.training_done(args.steps - self.first - self.skipped)
        if self.skipped and rank == 0:
            print(f"skipped {self.skipped} steps with a non-finite loss")
        val_loss = self.evaluate()
        peak = self.peak_memory()
        if rank == 0:
            if args.steps > self.first:
                tokens = args.batch_size * args.seq_len * self.replicas * (args.steps - self.first)
                print(f"trained {args.steps - self.first} steps in {elapsed:.1f} s ({tokens / elapsed:,.0f} tokens/s)")
            if args.eval_batches:
                print(f"val loss {val_loss:.6f}")
            print(f"peak memory {peak / 2**20:.2f} MiB per rank (the most on any rank; {self.peak_memory_kind()})")
        self.accounting.report()
        if self.recorded and rank == 0:
            self.write_trace()

    @torch.no_grad()
    def evaluate(self):
        if self.args.eval_batches == 0:
            return math.nan
        self.model.eval()
        loss_of = getattr(self.model, "eval_step", self.model)  # a pipeline's: the mean over its micro-batches
        total = sum(float(loss_of(*self.batch(i, "val"))) for i in range(self.args.eval_batches))
        self.model.train()
        return average_over_ranks(torch.tensor(total / self.args.eval_batches, device=self.device))

    def reset_peak(self):
        if self.memory is not None:
            self.memory.reset_peak()
        elif self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory(self):
        """Bytes at the peak on this rank, maxed over ranks."""
        peak = self.memory.peak if self.memory is not None else torch.cuda.max_memory_allocated(self.device)
        peak = torch.tensor(peak, dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return int(peak.item())

    def peak_memory_kind(self):
        if self.memory is not None:
            return "live tensor bytes in training and eval, counted by tiny_zero.measure.memory"
        return "torch.cuda.max_memory_allocated in training and eval"


def loop_collectives(model):
    """What the loop itself sends, outside tiny_zero.comm: Run.skip's and Run.log's all-reduces."""
    if getattr(model, "world_size", 1) == 1:
        return []
    return ["  not counted above: the loop's own 2 all-reduces of one number per step, over plain "
            "torch.distributed (Run.skip: a non-finite loss on any rank; Run.log: the mean loss)"]


def average_over_ranks(value):
    """The mean of a scalar tensor over ranks, as a float (ranks hold equal batches)."""
    value = value.float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value)  # plain torch.distributed: not counted in tiny_zero.comm's stats
        value /= dist.get_world_size()
    return value.item()


LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
          "comm_buffers": "comm buffers", "activations": "activations", "other": "other"}


class Accounting:
    """The end-of-run report: memory at the peak by category, next to what
    tiny_zero's partition holds and what the ZeRO formula says for this
    strategy and world size (tiny_zero.measure.estimate), and the communication of a
    training step next to the theory. train() makes one before the loop,
    calls training_done() after it and report() at the very end (on every
    rank: the ranks' peaks are gathered; rank 0 prints)."""

    def __init__(self, model, opt, memory, args):
        self.model, self.memory, self.args = model, memory, args
        wrappers = OTHER_WRAPPERS | {name: wrapper for name, (wrapper, _) in tiny_zero.STRATEGIES.items()}
        self.strategy = next((name for name, cls in wrappers.items() if isinstance(model, cls)), "single")
        if memory is not None:
            memory.attach(model, opt)  # from now on the breakdown is taken at each new peak
        self.sent = dict(comm.stats.elements)
        self.steps = 0

    def training_done(self, steps):
        """What the training steps sent (eval's forwards gather too: not counted)."""
        before, self.steps = self.sent, steps
        self.sent = {kind: count - before.get(kind, 0) for kind, count in comm.stats.elements.items()
                     if count > before.get(kind, 0)}

    def report(self):
        model, rank, n = self.model, getattr(self.model, "rank", 0), getattr(self.model, "world_size", 1)
        dtype = getattr(model, "param_dtype", None) or next(model.parameters()).dtype
        precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
        with torch.device("meta"):  # the model as built, for Ψ and the estimator: nothing allocated
            module = build_model(self.args)
        numel = sum(p.numel() for p in module.parameters())
        if self.strategy == "pipeline":
            lines = self.stage_lines(numel, n)
        elif self.strategy == "context":  # ddp's model state; its communication is attention's and ddp's
            lines = self.memory_lines(module, numel, precision, n) + self.context_comm_lines(module)
        elif self.strategy == "experts":  # the rest as its data-parallel strategy holds it; the experts apart
            rest = sum(p.numel() for p in model.module.parameters())
            lines = self.memory_lines(model.module, rest, precision, n) + self.experts_lines(module)
        elif self.strategy == "tensor":
            lines = self.memory_lines(model.module, sum(p.numel() for p in model.module.parameters()), precision, n)
            lines += self.tensor_comm_lines(module)
        else:
            lines = self.memory_lines(module, numel, precision, n) + self.comm_lines(module, numel, precision, n)
        if rank == 0:
            print("\n".join(line.rstrip() for line in lines))

    def memory_lines(self, module, numel, precision, n):
        memory, cuda = self.memory, self.memory is None
        mine = (memory.peak if memory is not None else torch.cuda.max_memory_allocated(),
                memory.peak_breakdown if memory is not None else None,
                (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()) if cuda else None,
                memory.peak_placement if memory is not None else None)
        everyone = [mine] * n
        if n > 1:
            dist.all_gather_object(everyone, mine)  # plain torch.distributed: not counted in comm.stats
        top = max(range(n), key=lambda r: everyone[r][0])
        peak, breakdown, allocator, placement = everyone[top]
        fmt = estimate.fmt_bytes
        # one device holds what ddp holds; a tensor parallel rank, what ddp would hold of its slices
        held_like = self.strategy if self.strategy not in ("single", "tensor", "context") else "ddp"
        if self.strategy == "experts":  # the rest, as its data-parallel strategy holds it
            held_like = next(name for name, (cls, _) in tiny_zero.STRATEGIES.items() if isinstance(self.model, cls))
        partition = estimate.model_state(module, held_like, n, precision)[top]
        formula = estimate.zero_formula(held_like, numel, n, precision)
        terms = estimate.formula_terms(held_like, precision)
        where = f"rank {top}, the highest of {n}" if n > 1 else "one device"
        lines = [f"memory at the peak ({where}), Ψ = {numel:,}"
                 + (" (what a rank holds: its slices, the rest whole)" if self.strategy == "tensor" else "")]
        if allocator is not None:
            lines.append(f"  CUDA: max_memory_allocated {fmt(allocator[0])}, max_memory_reserved {fmt(allocator[1])}")
        row = "  {:<17} {:>12} {:>14} {:>14}  {}"
        lines.append(row.format("", "measured" if breakdown else "", "tiny_zero", "ZeRO formula",
                                f"({self.strategy}, {precision or 'fp32'}, N={n})"))
        measured = {c: fmt(v) for c, v in breakdown.items()} if breakdown else dict.fromkeys(LABELS, "")
        for category in estimate.CATEGORIES:
            lines.append(row.format(LABELS[category], measured[category], fmt(partition[category]),
                                    fmt(formula[category]), estimate.term_text(*terms[category])))
        state = fmt(sum(breakdown[c] for c in estimate.CATEGORIES)) if breakdown else ""
        lines.append(row.format("= model state", state, fmt(sum(partition.values())), fmt(sum(formula.values())),
                                estimate.formula_text(held_like, precision)))
        if self.strategy == "offload":  # where it lives: the device keeps the parameters, the host the rest
            where = estimate.placement(module, self.strategy, n, precision)[top]
            for side, what in (("device", "parameters (+ activations, buckets in flight)"),
                               ("host", "grads, fp32 masters, moments, the copy back")):
                lines.append(row.format(f"on the {side}", fmt(placement[side]) if placement else "",
                                        fmt(where[side]), "", what))
        if not breakdown:
            lines.append("  (no breakdown: on CUDA the examples leave tiny_zero.measure.memory off)")
            return lines
        for category in ("comm_buffers", "activations", "other"):
            lines.append(row.format(LABELS[category], measured[category], "", "", ""))
        lines.append(row.format("total", fmt(peak), "", "", "live tensor bytes, tiny_zero.measure.memory"))
        lines.append("  (tiny_zero: what its partition holds after a step, with padding and owner table. The "
                     "peak comes in backward, when some grads are not made yet or sit in buckets: comm buffers)")
        return lines

    def context_comm_lines(self, module):
        """What a context-parallel step sent (attention's P2P or all-to-alls, the
        loss's and ddp's all-reduces), next to tiny_zero.measure.estimate."""
        model, args = self.model, self.args
        per_step = {kind: count / max(self.steps, 1) for kind, count in self.sent.items()}
        expected = estimate.context_comm_per_step(module, model.method, model.cp_size, model.dp_size,
                                                  args.batch_size, args.seq_len)
        sizes = lambda kinds: ", ".join(f"{kind} {count:,.0f}" for kind, count in kinds.items()) or "none"  # noqa: E731
        return [f"communication per training step (tiny_zero.comm, {self.steps} steps; every rank alike)",
                f"  collective sizes: {sizes(per_step)} elements", *loop_collectives(model),
                f"  tiny_zero.measure.estimate: {sizes(expected)} elements (without the grad norm's scalar all-reduce)"]

    def experts_lines(self, module):
        """The experts a rank holds and the all-to-alls a step sent (the ranks'
        mean), next to tiny_zero.measure.estimate, and the experts held
        without expert parallelism."""
        model, args, fmt = self.model, self.args, estimate.fmt_bytes
        held = 16 * sum(p.numel() for p in model.expert_params())  # fp32: the tensor, its grad, two moments
        sent = [self.sent.get("all_to_all", 0) / max(self.steps, 1)] * model.world_size
        if model.world_size > 1:
            dist.all_gather_object(sent, sent[0])  # plain torch.distributed: not counted in comm.stats
        expected = estimate.experts_comm_per_step(module, args.batch_size, args.seq_len)["all_to_all"]
        mine, whole = estimate.expert_state(module, model.ep_size), estimate.expert_state(module, 1)
        return [f"experts per rank (parameters, grads, AdamW state; in 'parameters' above too): {fmt(held)}; "
                f"tiny_zero.measure.estimate {fmt(mine)} at --ep-size {model.ep_size}, {fmt(whole)} at 1",
                f"all_to_all per training step, the ranks' mean: {sum(sent) / len(sent):,.0f} elements; "
                f"tiny_zero.measure.estimate {expected:,} (counts, dispatch and combine, forward and backward)"]

    def stage_lines(self, numel, n):
        """A pipeline's report, stage by stage (the first replica of each):
        the peak memory by category, measured, and what the stage sent per
        training step. ZeRO's formulas are for data parallelism: none here."""
        memory, fmt = self.memory, estimate.fmt_bytes
        sent = {kind: count / max(self.steps, 1) for kind, count in self.sent.items()}
        mine = (self.model.stage, memory.peak if memory is not None else torch.cuda.max_memory_allocated(),
                memory.peak_breakdown if memory is not None else None, sent)
        everyone = [mine] * n
        if n > 1:
            dist.all_gather_object(everyone, mine)  # plain torch.distributed: not counted in comm.stats
        lines = [f"memory at the peak and communication per training step, by stage, Ψ = {numel:,}"]
        for stage, peak, breakdown, kinds in everyone[::self.model.replicas]:
            held = ", ".join(f"{LABELS[c]} {fmt(v)}" for c, v in breakdown.items()) if breakdown else "on CUDA"
            moved = ", ".join(f"{kind} {count:,.0f}" for kind, count in kinds.items()) or "nothing"
            lines.append(f"  stage {stage}: peak {fmt(peak)} ({held}); sent {moved} elements")
        return lines

    def comm_lines(self, module, numel, precision, n):
        if self.strategy == "single":
            return ["communication: none (one device)"]
        per_step = {kind: count / max(self.steps, 1) for kind, count in self.sent.items()}
        sent = estimate.transfers_per_rank(per_step, n)
        expected = estimate.transfers_per_rank(estimate.comm_per_step(module, self.strategy, n, precision), n)
        theory = estimate.comm_theory(self.strategy, numel, n)
        multiple = 3 if self.strategy in ("zero3", "fsdp") else 2
        kinds = ", ".join(f"{kind} {count:,.0f}" for kind, count in per_step.items())
        return [f"communication per training step (tiny_zero.comm, {self.steps} steps; every rank alike)",
                f"  collective sizes: {kinds or 'none'} elements",
                *loop_collectives(self.model),
                f"  per rank: {sent:,.0f} element-transfers = {sent / numel:.3f}Ψ "
                f"(each rank moves (N-1)/N = {(n - 1) / n:.3f} of a collective, twice that of an all-reduce)",
                f"  tiny_zero.measure.estimate: {expected:,.0f} (without the grad norm's scalar all-reduce"
                + ("; a tied weight is gathered by each layer that uses it" if multiple == 3 else "")
                + ("; blocks recomputed under --checkpoint-activations gather once more"
                   if multiple == 3 and self.args.checkpoint_activations else "") + ")",
                f"  ZeRO theory: {multiple}Ψ(N-1)/N = {theory:,.0f}"]

    def tensor_comm_lines(self, module):
        model = self.model
        per_step = {kind: count / max(self.steps, 1) for kind, count in self.sent.items()}
        tokens = self.args.batch_size * self.args.seq_len
        expected = estimate.tensor_comm_per_step(module, model.plan, model.tp_size, model.replicas, tokens)
        kinds = ", ".join(f"{kind} {count:,.0f}" for kind, count in per_step.items())
        return [f"communication per training step (tiny_zero.comm, {self.steps} steps; every rank alike)",
                f"  collective sizes: {kinds or 'none'} elements",
                *loop_collectives(self.model),
                f"  tiny_zero.measure.estimate: all_reduce {expected['all_reduce']:,} (activations in each tensor "
                f"group of {model.tp_size}: 2 per block in forward, 2 in backward"
                + (", again in each checkpointed block's forward" if self.args.checkpoint_activations else "")
                + (f"; the grads a rank holds, across {model.replicas} replicas" if model.replicas > 1 else "")
                + "; without the grad norm's scalar all-reduce)"]
