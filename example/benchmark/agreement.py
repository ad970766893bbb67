"""What the agreement checks cost: training step time with tiny_zero.agreements.agree
as it is, against a no-op put in its place, on the example GPT.

    torchrun --nproc_per_node 2 example/benchmark/agreement.py
    torchrun --nproc_per_node 2 example/benchmark/agreement.py --strategies ddp,zero3 --steps 100

Before the first collective of every backward pass and before every
optimizer step, the ranks check that they are about to do the same thing
(tiny_zero/step.py: Wrapper.backward_started; tiny_zero/grads.py:
TorchGrads.stepping); zero3 and fsdp also check before gathering a layer
that the recorded order did not predict (tiny_zero/units.py: GatherOrder). Each check is one all-reduce of a few
integers on a gloo side group; ddp's step check goes out with the next
backward's, in one.

For each strategy, one model trains with the checks on and off, alternating
step by step (on, off, off, on, ...), so that whatever else loads the machine
falls on both alike. Each training step (forward, backward, clip_grad_norm_,
step, zero_grad) is timed by the wall clock from a barrier to the last rank's
end. Printed: the checks' round trips per step, the fastest and the median
step with and without them, and the wall-clock time of one check alone. Rank 0 prints a
markdown table.
"""
import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

import torch
import torch.distributed as dist

import tiny_zero
from example.model import CONFIGS, build_model
from tiny_zero import agreements
from tiny_zero.distributed import local_device

CHECK, SEND = agreements.agree, agreements._send  # the real ones


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=list(CONFIGS), help="model size (default: small)")
    p.add_argument("--strategies", default=",".join(tiny_zero.STRATEGIES),
                   help="comma-separated strategies to measure (default: all five)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step (default: 16)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--steps", type=int, default=40, help="timed steps with the checks, and as many without (default: 40)")
    args = p.parse_args()
    if args.seq_len > CONFIGS[args.model].block_size:
        p.error(f"--seq-len {args.seq_len} is longer than model {args.model}'s block_size")
    return args


@contextmanager
def checks(on, sends=None):
    """agreements.agree as it is (on) or a no-op (off); with `sends`, list the
    round trips the checks make (two checks may share one: agree's defer)."""
    def counted(group, checks_sent):
        sends.append([what for what, _ in checks_sent])
        return SEND(group, checks_sent)

    def skipped(what, **values):
        pass
    agreements.agree = CHECK if on else skipped
    agreements._send = counted if sends is not None else SEND
    try:
        yield
    finally:
        agreements.agree, agreements._send = CHECK, SEND


def batches(args, n, device):
    g = torch.Generator().manual_seed(dist.get_rank())
    vocab = CONFIGS[args.model].vocab_size
    tokens = [torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=g).to(device) for _ in range(n)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def train_step(model, opt, x, y):
    loss = model(x, y)
    loss.backward()
    model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()


def slowest_rank(seconds, device):
    t = torch.tensor(seconds, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(model, opt, x, y):
    """Seconds of one training step: from a barrier to the last rank's end."""
    dist.barrier()
    start = time.perf_counter()
    train_step(model, opt, x, y)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)  # the step's kernels are done, not just queued
    return slowest_rank(time.perf_counter() - start, model.device)


def one_check(device, n=100, rounds=5):
    """Seconds of one agreement alone: every rank calls it n times in a row;
    the fastest of a few rounds."""
    best = float("inf")
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for i in range(n):
            CHECK("the benchmark", value=i)
        best = min(best, slowest_rank(time.perf_counter() - start, device) / n)
    return best


def measure(name, args):
    """(round trips of the checks per step, step times with the checks, without them)."""
    wrapper, optimizer = tiny_zero.STRATEGIES[name]
    model = wrapper(build_model(args.model, seed=0))
    opt = optimizer(model, lr=1e-4)
    data = batches(args, 4, model.device)
    for x, y in data[:2]:  # warm-up; zero3/fsdp record their layer order
        train_step(model, opt, x, y)
    calls = []
    with checks(True, calls):
        train_step(model, opt, *data[2])
    times = {True: [], False: []}
    for i in range(2 * args.steps):
        on = i % 4 in (0, 3)  # on, off, off, on: each setting goes first as often as second
        with checks(on):
            times[on].append(timed(model, opt, *data[i % len(data)]))
    return len(calls), times[True], times[False]


def main():
    args = parse_args()
    names = args.strategies.split(",")
    unknown = [n for n in names if n not in tiny_zero.STRATEGIES]
    if unknown:
        raise SystemExit(f"error: unknown strategies {unknown}; choose from {list(tiny_zero.STRATEGIES)}")
    torch.manual_seed(0)
    rows = [measure(name, args) for name in names]  # the first wrapper creates the process group
    alone = one_check(local_device())
    if dist.get_rank() == 0:
        print(f"model {args.model}, {dist.get_world_size()} ranks, batch {args.batch_size}x{args.seq_len} per rank, "
              f"{args.steps} steps with the checks and {args.steps} without, alternating, wall clock; "
              f"one check alone: {alone * 1e6:.0f} us\n")
        print("| strategy | check round trips per step | step with checks: fastest, median | without: fastest, median "
              "| with / without: fastest, median |")
        print("|---|---:|---:|---:|---:|")
        for name, (count, on, off) in zip(names, rows):
            (on_min, on_med), (off_min, off_med) = summary(on), summary(off)
            print(f"| {name} | {count} | {on_min * 1e3:.1f} ms, {on_med * 1e3:.1f} ms | "
                  f"{off_min * 1e3:.1f} ms, {off_med * 1e3:.1f} ms | {on_min / off_min:.3f}, {on_med / off_med:.3f} |")
    dist.destroy_process_group()


def summary(times):
    return min(times), statistics.median(times)


if __name__ == "__main__":
    main()
