"""Train a model on one device with tiny_zero's layers and AdamW:
an example GPT or Llama, or a saved Hugging Face model (--model hf:DIR).

Run with python (one process); flags: --help.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

from example import train_common as common
import tiny_zero


def main():
    args = common.parse_args(__doc__)
    data = common.load_data(args)
    with common.Run(args, data) as run:
        module = common.build_model(args)
        common.load_weights(module, args)  # --model hf:DIR: the saved weights
        model = tiny_zero.module.swap_layers(module).to(args.device, common.single_device_dtype(args))
        opt = tiny_zero.optim.AdamW(common.param_groups(model, args), lr=args.lr)
        sched = common.schedule(opt, args)
        for step in run.steps(model, opt, sched):
            x, y = run.batch(step)
            loss = model(x, y)
            if run.skip(loss, step):
                continue
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), common.MAX_GRAD_NORM)
            opt.step()
            sched.step()
            opt.zero_grad()
            run.log(step, loss)
        run.finish()


if __name__ == "__main__":
    main()
