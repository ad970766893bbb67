"""Train the example GPT with context parallelism (each sequence split across ranks).

Run with python (one process) or torchrun --nproc_per_node N; --cp-size C (N by
default) ranks split each sequence, N / C replicas split the batch. The ring
needs --seq-len divisible by 2C, Ulysses the heads by C. --cp-size 1 is the
run without context parallelism (ddp over N replicas) to compare the memory
report with: the activations per rank are 1/C of its; flags: --help.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

from example import train_common as common
from tiny_zero.context import ContextParallel, ContextParallelAdamW


def add_flags(parser):
    parser.add_argument("--method", choices=["ring", "ulysses"], default="ring",
                        help="ring attention (k and v passed round the ranks) or Ulysses (all-to-all of heads)")
    parser.add_argument("--cp-size", type=int, default=None,
                        help="ranks that split each sequence (default: every rank; 1: no context parallelism)")


def main():
    args = common.parse_args(__doc__, add_flags=add_flags)
    data = common.load_data(args)  # first: a bad --data exits with one line, before any process group
    with common.Run(args, data) as run:
        model = ContextParallel(common.build_model(args), method=args.method, cp_size=args.cp_size,
                                **common.strategy_options(args))
        opt = ContextParallelAdamW(model, common.param_groups(model.module, args), lr=args.lr)
        sched = common.schedule(opt, args)
        for step in run.steps(model, opt, sched):
            x, y = run.batch(step)  # the replica's whole rows: the wrapper keeps this rank's tokens
            loss = model(x, y)  # the loss over the whole sequences, on every rank
            if run.skip(loss, step):
                continue
            loss.backward()
            model.clip_grad_norm_(common.MAX_GRAD_NORM)
            opt.step()
            sched.step()
            opt.zero_grad()
            run.log(step, loss)
        run.finish()


if __name__ == "__main__":
    main()
