"""Train a model on one device with tiny_zero's layers and AdamW:
an example GPT or Llama, or a saved Hugging Face model (--model hf:DIR).

Run with python (one process); flags: --help.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

from example import train_common as common
import tiny_zero


def main():
    args = common.parse_args(__doc__)
    data = common.load_data(args)  # first: a bad --data exits with one line, before any process group
    with common.memory_tracker(args) as memory:
        module = common.build_model(args)
        common.load_weights(module, args)  # --model hf:DIR: the saved weights
        model = tiny_zero.module.swap_layers(module).to(args.device, common.single_device_dtype(args))
        opt = tiny_zero.optim.AdamW(common.param_groups(model, args), lr=args.lr)
        common.train(model, opt, data, args, memory)


if __name__ == "__main__":
    main()
