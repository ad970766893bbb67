"""Every finished run exits 0: many short worlds under real torchrun, two at a
time, and every exit code must be 0.

    python tests/stress_exits.py [--worlds 40]

A run that went right used to abort now and then on its way out
("terminate called without an active exception", SIGABRT, on one rank):
gloo's worker thread let go of a finished collective during the
interpreter's teardown (tiny_zero/comm.py: _settle_at_exit). It came most
often right after a checkpoint resume at world 3, so most worlds here are
those: two worlds of 2 save a checkpoint (fsdp, ddp), then worlds of 3 load
one and train a few steps, under every data-parallel strategy, half of them
ending with dist.destroy_process_group() and half without; every fourth
world trains from scratch instead, at world 2. The worlds are tiny: the time goes to
starting the processes. The script prints each failed world's output and
exits non-zero if any world did.

Run by .ci/run after pytest. The worker side (--worker) is what torchrun
starts on every rank.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp", "offload"]
SAVED = ["fsdp", "ddp"]  # the checkpoints the resumes load (saved at world 2)
STEPS = 2


def worlds(count, root):
    """[(world size, worker arguments)]: the two saves first, then resumes
    and trainings from scratch, strategies and endings in turn."""
    out = [(2, ["save", name, str(root / name), "destroy"]) for name in SAVED]
    for i in range(count - len(out)):
        name = STRATEGIES[i % len(STRATEGIES)]
        ending = "destroy" if i % 2 else "exit"
        if i % 4 == 3:
            out.append((2, ["train", name, "-", ending]))
        else:
            out.append((3, ["load", name, str(root / SAVED[i % len(SAVED)]), ending]))
    return out


def launch(world_size, args):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
               __file__, "--worker", *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, default=40)
    args = p.parse_args()
    started = time.monotonic()
    failed = 0
    with tempfile.TemporaryDirectory() as root:
        plan = worlds(args.worlds, Path(root))
        for i in range(0, len(plan), 2):  # two at a time: the saves are the first pair
            pair = [(size, argv, launch(size, argv)) for size, argv in plan[i:i + 2]]
            for size, argv, proc in pair:
                output = proc.communicate(timeout=600)[0]
                if proc.returncode != 0:
                    failed += 1
                    print(f"world of {size} ({' '.join(argv)}) exited {proc.returncode}:\n{output[-3000:]}")
    print(f"{len(plan)} worlds, two at a time: {failed} exited non-zero, in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


# ---------------------------------------------------------------- on every rank

def worker(action, name, path, ending):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    import tiny_zero
    from tiny_zero import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
            self.head = nn.Linear(8, 16)

        def forward(self, x):
            h = self.emb(x)
            for block in self.blocks:
                h = torch.tanh(block(h))
            return F.cross_entropy(self.head(h).flatten(0, 1), x.flatten())

    torch.set_num_threads(1)
    torch.manual_seed(0)
    wrapper_cls, opt_cls = tiny_zero.STRATEGIES[name]
    model = wrapper_cls(Net())
    opt = opt_cls(model, lr=1e-2)
    if action == "load":
        checkpoint.load(path, model, opt)
    for step in range(STEPS):
        x = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        loss = model(x)
        model.backward(loss)
        opt.step()
        opt.zero_grad()
    if not torch.isfinite(loss):
        raise RuntimeError(f"loss {loss.item()}")
    if action == "save":
        checkpoint.save(path, model, opt, step=STEPS)
    if ending == "destroy":
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:])
    else:
        sys.exit(main())
