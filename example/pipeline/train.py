"""Train the example GPT with pipeline parallelism (GPipe or 1F1B).

Run with torchrun --nproc_per_node N (or python, one process: one stage);
flags: --help. The GPT is cut into --stages stages (default: one per rank),
balanced by parameter count; with N = stages × replicas, each replica takes
--batch-size sequences per step, in --microbatches micro-batches.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

from example import train_common as common
from example.model import build_sequential, loss_fn
from tiny_zero.pipeline import Pipeline, PipelineAdamW


def pipeline_flags(p):
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default: 4)")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b", help="the order of forwards and "
                   "backwards (default: 1f1b)")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default: one per rank)")


def main():
    args = common.parse_args(__doc__, add_flags=pipeline_flags)
    data = common.load_data(args)
    with common.Run(args, data) as run:
        seq = build_sequential(args.model, seed=args.seed, device="meta",  # each rank materialises its stage
                               checkpoint_activations=args.checkpoint_activations)
        model = Pipeline(seq, loss_fn, microbatches=args.microbatches, schedule=args.schedule, stages=args.stages,
                         **common.strategy_options(args))
        opt = PipelineAdamW(model, common.param_groups(model.module, args), lr=args.lr)
        sched = common.schedule(opt, args)
        for step in run.steps(model, opt, sched):
            x, y = run.batch(step)
            loss = model.train_step(x, y)  # forward and backward of every micro-batch
            if run.skip(loss, step):
                opt.zero_grad()
                continue
            model.clip_grad_norm_(common.MAX_GRAD_NORM)
            opt.step()
            sched.step()
            opt.zero_grad()
            run.log(step, loss)
        run.finish()


if __name__ == "__main__":
    main()
