"""Train a model with FSDP (every tensor split across ranks):
an example GPT or Llama, or a saved Hugging Face model (--model hf:DIR).

Run with python (one process) or torchrun --nproc_per_node N; flags: --help.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

from example import train_common as common
from tiny_zero.fsdp import FSDP, FSDPAdamW


def main():
    args = common.parse_args(__doc__)
    data = common.load_data(args)  # first: a bad --data exits with one line, before any process group
    with common.Run(args, data) as run:
        model = FSDP(common.build_model(args), **common.strategy_options(args))
        common.load_weights(model, args)  # --model hf:DIR: each rank reads the parts it holds
        opt = FSDPAdamW(model, common.param_groups(model.module, args), lr=args.lr)
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
