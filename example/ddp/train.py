"""Train a model with DDP (every rank holds everything):
an example GPT or Llama, or a saved Hugging Face model (--model hf:DIR).

Run with python (one process) or torchrun --nproc_per_node N; flags: --help.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

from example import train_common as common
from tiny_zero.ddp import DDP, DDPAdamW


def main():
    args = common.parse_args(__doc__)
    data = common.load_data(args)  # first: a bad --data exits with one line, before any process group
    with common.memory_tracker(args) as memory:
        module = common.build_model(args)
        groups = common.param_groups(module, args)  # before wrapping: zero3 and fsdp empty what a rank does not hold
        model = DDP(module, **common.strategy_options(args))
        common.load_weights(model, args)  # --model hf:DIR: each rank reads the parts it holds
        opt = DDPAdamW(model, groups, lr=args.lr)
        common.train(model, opt, data, args, memory)


if __name__ == "__main__":
    main()
