"""Train the example MoE GPT with expert parallelism (each MoE block's experts spread over ranks).

Run with python (one process) or torchrun --nproc_per_node N; --ep-size P (N
by default) ranks split the experts of each MoE block, and the N / P groups
of them are replicas of the experts; every rank takes its own rows of the
batch, as under ddp. --strategy holds the rest of the model (attention,
norms, embeddings, routers) as ddp, zero1 or zero2 holds it over all N
ranks. --model moe-small (the default) or moe-tiny (example/model.py: an MoE
MLP in every other block). The run reports the experts a rank holds and the all-to-alls
it sent, next to tiny_zero.measure.estimate. Flags: --help.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

from example import train_common as common
from tiny_zero.experts import data_parallel


def add_flags(parser):
    parser.set_defaults(model="moe-small")  # the other examples' small GPT, with an MoE MLP every other block
    parser.add_argument("--ep-size", type=int, default=None,
                        help="ranks that split each MoE block's experts (default: every rank)")
    parser.add_argument("--strategy", choices=["ddp", "zero1", "zero2"], default="ddp",
                        help="how the rest of the model is held over all ranks (default: ddp)")


def main():
    args = common.parse_args(__doc__, add_flags=add_flags)
    if not args.model.startswith("moe-"):
        raise SystemExit(f"error: --model {args.model} has no MoE block: give moe-tiny or moe-small")
    data = common.load_data(args)  # first: a bad --data exits with one line, before any process group
    wrapper, adamw = data_parallel(args.strategy)
    with common.Run(args, data) as run:
        model = wrapper(common.build_model(args), ep_size=args.ep_size, **common.strategy_options(args))
        opt = adamw(model, common.param_groups(model.module, args), lr=args.lr)
        sched = common.schedule(opt, args)
        for step in run.steps(model, opt, sched):
            x, y = run.batch(step)  # this rank's own rows
            loss = model(x, y)  # its rows' cross-entropy + the whole batch's load-balancing loss
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
