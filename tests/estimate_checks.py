"""Worker for the estimator test (run on every rank): what each strategy
holds and sends in one step of the tiny GPT, measured, for tiny_zero.measure.estimate
to be compared with."""
import torch
import torch.distributed as dist

import tiny_zero
from tiny_zero import comm
from tiny_zero.measure.memory import TensorMemory
from example.model import build_model

BUCKET_BYTES = 16 * 1024  # several buckets, so the padding of each shows


def batch():
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2 * world, 33), generator=g)[2 * rank:2 * rank + 2]
    return tokens[:, :-1], tokens[:, 1:]


def one_step(name, mixed_precision):
    """After one step (before zero_grad): this rank's breakdown and its total,
    the step's collectives; the breakdown after forward, and at every grad
    that backward hands to a bucket (for the comm buffers)."""
    wrapper_cls, opt_cls = tiny_zero.STRATEGIES[name]
    options = {} if name == "fsdp" else {"bucket_bytes": BUCKET_BYTES}
    with TensorMemory() as memory:
        model = wrapper_cls(build_model("tiny"), mixed_precision=mixed_precision, **options)
        opt = opt_cls(model, lr=1e-3)
        memory.attach(model, opt)
        samples = []
        if model.buckets.flat is None:  # zero2, zero3, fsdp: grads go through temporary bucket buffers
            add = model.buckets.add

            def sampled_add(param, grad, send=True):
                ready = add(param, grad, send)
                samples.append(memory.breakdown())
                return ready
            model.buckets.add = sampled_add
        comm.stats.reset()
        loss = model(*batch())
        after_forward = memory.breakdown()
        model.backward(loss)
        del loss
        opt.step()
        sent = dict(comm.stats.elements)
        memory.settle()  # gloo's thread may still hold a finished collective's buffer
        held = memory.breakdown()
        placement = memory.placement()
        biggest_bucket = max(b.numel for b in model.buckets) * torch.finfo(model.reduce_dtype).bits // 8
        return dict(held=held, after_forward=after_forward, current=memory.current, peak=memory.peak,
                    peak_breakdown=memory.peak_breakdown, sent=sent, samples=samples,
                    biggest_bucket=biggest_bucket, placement=placement)


def measure_all(names, precisions):
    return {(name, precision): one_step(name, precision) for name in names for precision in precisions}
