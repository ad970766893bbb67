"""Reads on the host of values computed from the model's data: each one, on a
GPU, waits for the device to drain its queue (.item(), float(t), bool(t),
torch.equal). HostReads, a TorchDispatchMode, follows the model's data
through every op: a storage that an op touches along with a tainted one is
tainted (the parameters, their grads, the batch to begin with), and a host read of a
tainted tensor is recorded with the line that made it. A step counter or an
agreement's message, made from host numbers, is not the model's data and may
be read."""
import traceback
from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
         torch.ops.aten.equal.default, torch.ops.aten.allclose.default}


class HostReads(TorchDispatchMode):
    def __init__(self, tainted):
        super().__init__()
        self.storages = set()  # the tainted storages: a view, a flat buffer and its pieces share one
        self.taint(tainted)
        self.reads = []  # (op, the line that read)

    def taint(self, tensors):
        self.storages.update(StorageWeakRef(t.untyped_storage()) for t in tensors)

    def is_tainted(self, t):
        return StorageWeakRef(t.untyped_storage()) in self.storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        dirty = any(self.is_tainted(t) for t in inputs)
        if dirty and func in READS:
            self.reads.append((str(func), caller()))
        out = func(*args, **kwargs)
        if dirty:  # what the op made, and what it wrote into (an in-place op, a collective's output)
            self.taint(inputs + [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
        return out


def caller():
    """The innermost line outside torch and this file."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and not frame.filename.endswith("host_reads.py"):
            return f"{frame.filename}:{frame.lineno} {frame.line}"
    return "?"


def strategy_steps(strategies, precisions):
    """Worker: every strategy's steady-state steps (two micro-batches, the
    first under no_sync, then on alternate steps a clip, the step, zero_grad)
    under HostReads; returns the reads, which must be none. Under fp16 one
    measured step overflows (an inf loss on the last rank) and must be
    skipped, which the host learns only when it asks, after the steps."""
    import torch.distributed as dist
    import tiny_zero
    from semantics_checks import LoopNet, global_batch, my_rows
    from tiny_zero.precision import LossScaler
    found = []
    for name in strategies:
        for precision in precisions:
            wrapper, optimizer = tiny_zero.STRATEGIES[name]
            torch.manual_seed(0)
            options = {"loss_scaler": LossScaler(init_scale=2**8)} if precision == "fp16" else {}
            model = wrapper(LoopNet(), mixed_precision=precision, **options)
            opt = optimizer(model, lr=1e-2)
            for step in range(6):
                batches = [my_rows(global_batch(step, micro)) for micro in range(2)]
                seeds = [p for _, p in model.module.named_parameters()] + list(model.shards) + \
                    list(model.grads.values()) + [t for batch in batches for t in batch]
                with HostReads(seeds) if step >= 2 else nullcontext() as reads:  # the first two warm up
                    for micro, (x, y) in enumerate(batches):
                        with model.no_sync() if micro == 0 else nullcontext():
                            loss = model(x, y)
                            if precision == "fp16" and step == OVERFLOW and dist.get_rank() == dist.get_world_size() - 1:
                                loss = loss * float("inf")
                            model.backward(loss)
                    if step % 2 == 0:
                        model.clip_grad_norm_(1.0)
                    opt.step()
                    opt.zero_grad()
                if reads is not None:
                    found += [f"{name} {precision} step {step}: {op} at {line}" for op, line in reads.reads]
            if precision == "fp16" and (opt.skipped_steps, model.loss_scale) != (1, 2.0**8):
                found.append(f"{name} fp16: {opt.skipped_steps} steps skipped, loss scale {model.loss_scale}; "
                             "expected the one overflow skipped, the scale kept (hysteresis 2)")
    return found


OVERFLOW = 3  # the fp16 step whose loss is inf on one rank
