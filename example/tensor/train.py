"""Train the example GPT with tensor parallelism (each block's Linears split across ranks).

Run with python (one process) or torchrun --nproc_per_node N, where N divides
the model's number of heads (each rank computes the heads of its share); flags: --help.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

from example import train_common as common
from tiny_zero.tensor import TensorParallel, TensorParallelAdamW

PLAN = {  # Megatron's: the first Linear of attention and of the MLP by output, the second by input
    "blocks.*.attn.c_attn": ("column", 3),  # fused [q; k; v]: each part split alone, so a rank keeps whole heads
    "blocks.*.attn.c_proj": "row",
    "blocks.*.mlp.c_fc": "column",
    "blocks.*.mlp.c_proj": "row",
}


def main():
    args = common.parse_args(__doc__)
    data = common.load_data(args)  # first: a bad --data exits with one line, before any process group
    with common.Run(args, data) as run:
        model = TensorParallel(common.build_model(args), PLAN, **common.strategy_options(args))
        opt = TensorParallelAdamW(model, common.param_groups(model.module, args), lr=args.lr)
        sched = common.schedule(opt, args)
        for step in run.steps(model, opt, sched):
            x, y = run.batch(step)
            loss = model(x, y)
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
