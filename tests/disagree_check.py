"""One rank does what the others do not; run as one process per rank by
tests/test_semantics.py: `python tests/disagree_check.py STRATEGY CASE`.

    no_sync   at step 2, rank 1 runs its backward inside no_sync(), rank 0 does not
    layer     at step 2, rank 1 uses a layer that rank 0 does not
    step      at step 2, rank 1 sets a p.grad to None before the optimizer
              step: the ranks would step different parameters
    last_step the same at the last step (3), after which nothing is sent:
              told at exit, on every rank (which then exit 0)
    write     at step 2, rank 1 writes a parameter in place (in bf16, where
              zero3 refuses such a write with a collective of its own)
    save      as last_step, then tiny_zero.checkpoint.save into $SAVE_DIR:
              the step's disagreement is told there, before anything is
              written
    clip      at step 2, rank 1 alone calls model.clip_grad_norm_
    skip      at step 2, rank 1 skips its backward pass (as a loop that
              skips a batch whose loss is not finite would): the ranks are
              at different checks, and their messages are the same size
    rank0_eval  at step 2, before its training forward, rank 0 alone runs an
              evaluation forward outside torch.no_grad()
    rank0_state_dict   at step 2, after the step, rank 0 alone takes
              model.state_dict() and saves it, then every rank calls
              dist.barrier(), as torch DDP's tutorial does (ddp: no error)
    rank0_state_dict_no_barrier   the same without the barrier

Every rank must end in tiny_zero's error and exit non-zero; on success the
script prints "no error" and exits 0. Each rank prints when it reaches step
2, so the test can time the exit from there (not from start-up)."""
import os
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from semantics_checks import global_batch, make_tiny, my_rows  # noqa: E402
from tiny_zero import checkpoint, comm  # noqa: E402


def main():
    name, case = sys.argv[1:3]
    comm.set_timeout(float(os.environ["TIMEOUT"]))
    dist.init_process_group("gloo")
    model, opt = make_tiny(name, **({"mixed_precision": "bf16"} if case == "write" else {}))
    rank = dist.get_rank()
    for step in range(4):
        odd = step == 2 and rank == 1
        if step == 2:
            print(f"reached step 2 at {time.time()}", flush=True)  # the test times the exit from here
        model.module.use_sometimes = step % 2 == 0
        if case == "layer" and odd:
            model.module.use_sometimes = not model.module.use_sometimes
        if case == "rank0_eval" and step == 2 and rank == 0:
            model(*my_rows(global_batch(step)))
        loss = model(*my_rows(global_batch(step)))
        if case == "no_sync" and odd:
            with model.no_sync():
                loss.backward()
        elif case == "skip" and odd:
            pass
        else:
            loss.backward()
        if (case == "step" and odd) or (case in ("last_step", "save") and step == 3 and rank == 1):
            next(model.module.parameters()).grad = None
        if case == "clip" and odd:
            model.clip_grad_norm_(1.0)
        if case == "write" and odd:
            write_one_parameter(model.module)
        opt.step()
        opt.zero_grad()
        if case.startswith("rank0_state_dict") and step == 2:
            if rank == 0:
                torch.save(model.state_dict(), Path(os.environ["SAVE_DIR"]) / "model.pt")
                if name == "ddp":  # the values the module holds, to compare with
                    torch.save(model.module.state_dict(), Path(os.environ["SAVE_DIR"]) / "module.pt")
            if case == "rank0_state_dict":
                dist.barrier()
    if case == "save":
        checkpoint.save(Path(os.environ["SAVE_DIR"]) / "ckpt", model, opt)
    print("no error")


def write_one_parameter(module):
    """Halve the first parameter this rank holds whole (torch refuses a
    write into a released one, which all share one element)."""
    for p in module.parameters():
        try:
            with torch.no_grad():
                p.mul_(0.5)
            return
        except RuntimeError:
            continue
    raise AssertionError("no parameter could be written")


if __name__ == "__main__":
    main()
