"""Train the example GPT with context parallelism (each sequence split across ranks).

Run with python (one process) or torchrun --nproc_per_node N; --cp-size C (N by
default) ranks split each sequence, N / C replicas split the batch. The ring
needs --seq-len divisible by 2C, Ulysses the heads by C. --cp-size 1 is the
run without context parallelism (ddp over N replicas) to compare the memory
report with: the activations per rank are 1/C of its. The run reports the
activations a rank saves in a forward, measured, next to
tiny_zero.measure.estimate's at C and at 1; --max-activation-mib refuses a run
whose estimate exceeds a budget. Flags: --help.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

from example import train_common as common
from example.model import CONFIGS, GPTConfig
from tiny_zero.context import ContextParallel, ContextParallelAdamW
from tiny_zero.measure import estimate


def add_flags(parser):
    parser.add_argument("--method", choices=["ring", "ulysses"], default="ring",
                        help="ring attention (k and v passed round the ranks) or Ulysses (all-to-all of heads)")
    parser.add_argument("--cp-size", type=int, default=None,
                        help="ranks that split each sequence (default: every rank; 1: no context parallelism)")
    parser.add_argument("--max-activation-mib", type=float, default=None,
                        help="refuse the run if a rank's activations, estimated by tiny_zero.measure.estimate, "
                             "exceed this many MiB (the example GPTs only; default: no limit)")


def estimated_activations(args, cp_size):
    """Bytes a rank saves in a training forward, by the estimator; None for a model it does not count."""
    if not isinstance(CONFIGS.get(args.model), GPTConfig) or args.seq_len % cp_size:
        return None  # a length that does not split is refused by the wrapper, with its own error
    return estimate.context_activations(estimate.build_meta(args.model), args.batch_size, args.seq_len, cp_size)


def check_budget(args):
    """Before any process group: a run whose activations per rank exceed --max-activation-mib stops here."""
    if args.max_activation_mib is None:
        return
    cp_size = args.cp_size or int(os.environ.get("WORLD_SIZE", "1"))
    need = estimated_activations(args, cp_size)
    if need is None:
        raise SystemExit("error: --max-activation-mib needs an example GPT (example/model.py) and a --seq-len "
                         "that splits over --cp-size")
    if need > args.max_activation_mib * 2**20:
        raise SystemExit(f"error: {args.batch_size} sequences of {args.seq_len} tokens on {cp_size} rank(s) need "
                         f"{estimate.fmt_bytes(need)} of activations per rank (estimated), over --max-activation-mib "
                         f"{args.max_activation_mib:g}: split each sequence over more ranks (--cp-size)")


def activation_lines(args, cp_size, saved):
    """The activations a rank saved in the first forward, next to the estimate with and without the split."""
    fmt = estimate.fmt_bytes
    split, whole = estimated_activations(args, cp_size), estimated_activations(args, 1)
    lines = ["activations per rank at the end of a training forward (what autograd saves for backward)",
             f"  measured (first step, tiny_zero.measure.memory): {fmt(saved) if saved is not None else 'not on CUDA'}"]
    if split is not None:
        lines.append(f"  tiny_zero.measure.estimate: {fmt(split)} at --cp-size {cp_size}; without context "
                     f"parallelism (--cp-size 1) {fmt(whole)}, {whole / split:.2f}x")
    return lines


def main():
    args = common.parse_args(__doc__, add_flags=add_flags)
    check_budget(args)
    data = common.load_data(args)  # first: a bad --data exits with one line, before any process group
    with common.Run(args, data) as run:
        model = ContextParallel(common.build_model(args), method=args.method, cp_size=args.cp_size,
                                **common.strategy_options(args))
        opt = ContextParallelAdamW(model, common.param_groups(model.module, args), lr=args.lr)
        sched = common.schedule(opt, args)
        saved = None
        for step in run.steps(model, opt, sched):
            x, y = run.batch(step)  # the replica's whole rows: the wrapper keeps this rank's tokens
            loss = model(x, y)  # the loss over the whole sequences, on every rank
            if saved is None and run.memory is not None:
                saved = run.memory.breakdown()["activations"]  # before backward frees them
            if run.skip(loss, step):
                continue
            loss.backward()
            model.clip_grad_norm_(common.MAX_GRAD_NORM)
            opt.step()
            sched.step()
            opt.zero_grad()
            run.log(step, loss)
        run.finish()
        if model.rank == 0:
            print("\n".join(activation_lines(args, model.cp_size, saved)))


if __name__ == "__main__":
    main()
