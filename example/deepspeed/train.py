"""A DeepSpeed training script, run by tiny_zero: the one change is the import.

    torchrun --nproc_per_node 2 example/deepspeed/train.py
    python example/deepspeed/train.py --steps 5           # one process
    torchrun --nproc_per_node 2 example/deepspeed/train.py --deepspeed   # DeepSpeed itself, if installed

The loop is DeepSpeed's: engine(x, y), engine.backward(loss), engine.step().
ds_config.json beside this file says how it trains; docs/deepspeed.md says
what each key does here, and `python -m tiny_zero.explain
example/deepspeed/ds_config.json --model small --world 2` what a rank holds
and sends.
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

from example.data import ByteData, load_text
from example.model import build_model

HERE = Path(__file__).resolve().parent


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed_config", default=str(HERE / "ds_config.json"), help="DeepSpeed's JSON config")
    p.add_argument("--deepspeed", action="store_true", help="train with DeepSpeed itself, not tiny_zero")
    p.add_argument("--model", default="small", help="a config name of example/model.py (default: small)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps (default: 50)")
    p.add_argument("--save", default=None, help="save a checkpoint here at the end")
    return p.parse_args()


def import_library(use_deepspeed):
    if not use_deepspeed:
        import tiny_zero as deepspeed  # the one line that differs from a DeepSpeed script
        return deepspeed
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    import deepspeed
    if not torch.cuda.is_available():
        import deepspeed.ops
        # on the CPU its process group first compiles a shared-memory all-reduce (minutes on 2 cores)
        # that only inference and tensor parallelism use
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def main():
    args = parse_args()
    deepspeed = import_library(args.deepspeed)
    model = build_model(args.model)
    engine, optimizer, _, scheduler = deepspeed.initialize(args=args, model=model,
                                                           model_parameters=model.parameters())
    rank, world_size = engine.global_rank, engine.world_size
    data = ByteData(load_text(), seq_len=model.config.block_size)
    micro = engine.train_micro_batch_size_per_gpu()
    for micro_step in range(args.steps * engine.gradient_accumulation_steps()):
        x, y = data.get_batch("train", micro, micro_step, rank=rank, world_size=world_size)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        if rank == 0 and (micro_step + 1) % engine.gradient_accumulation_steps() == 0:
            print(f"step {engine.global_steps:4d}  micro-step {micro_step:4d}  loss {loss.item():.4f}  "
                  f"lr {engine.get_lr()[0]:.2e}")
    if args.save:
        engine.save_checkpoint(args.save)


if __name__ == "__main__":
    main()
