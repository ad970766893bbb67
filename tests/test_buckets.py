"""tiny_zero.buckets.Buckets. Without a flat buffer of all buckets (zero2,
zero3, fsdp, offload), a bucket's grads have memory from its first grad until
the strategy frees them, in a tensor made once; with one (ddp, zero1), each
parameter's place in it is a view made once. What a step tracks per
parameter is kept by its index."""
import torch

from tiny_zero.buckets import Buckets, buckets_from_runs


def storage_bytes(bucket):
    return 0 if bucket.buffer is None else bucket.buffer.untyped_storage().nbytes()


def test_a_buckets_grads_have_memory_from_its_first_grad_until_freed():
    a, b, c = torch.zeros(3), torch.zeros(2, 2), torch.zeros(5)
    bucket, later = buckets_from_runs([[a, b], [c]], pad_to=4)
    buckets = Buckets([bucket, later], torch.float32, torch.device("cpu"))
    assert bucket.grads is None and storage_bytes(bucket) == 0 and storage_bytes(later) == 0  # none until a grad
    buckets.forward_uses(buckets.indices([a, b, c]), False)
    buckets.forward_uses(buckets.indices([b]), False)  # b is used twice: two grad contributions

    assert buckets.add(b, torch.full((2, 2), 1.0)) == []
    assert bucket.grads is bucket.buffer and storage_bytes(bucket) == 8 * 4  # the whole bucket, zeros but b's
    assert buckets.add(a, torch.arange(3.0)) == []  # b still has a use to come
    sent = buckets.add(b, torch.full((2, 2), 2.0))
    assert sent == [bucket]
    assert bucket.numel == 8  # 7 padded to 4
    assert torch.equal(bucket.grads, torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 3.0, 3.0, 0.0]))
    assert later.grads is None and storage_bytes(later) == 0  # c got no grad: no memory for it
    view = buckets.grad_views[buckets.index[id(a)]]
    buckets.free(bucket)  # the strategy sent it
    assert bucket.grads is None and storage_bytes(bucket) == 0
    buckets.forward_uses(buckets.indices([a]), False)
    buckets.add(a, torch.ones(3))  # the next backward: memory again, zeros, and the views made once still hold
    assert storage_bytes(bucket) == 8 * 4 and torch.equal(view, torch.ones(3))
    assert torch.equal(bucket.grads, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]))


def test_clear_frees_the_grads():
    a, b = torch.zeros(2), torch.zeros(2)
    (bucket,) = buckets_from_runs([[a, b]])
    buckets = Buckets([bucket], torch.float32, torch.device("cpu"))
    buckets.forward_uses(buckets.indices([a, b]), False)
    buckets.add(a, torch.ones(2))
    buckets.clear()
    assert bucket.grads is None and storage_bytes(bucket) == 0 and not buckets.got_grad


def test_per_parameter_state_is_kept_by_index():
    """A flat buffer (ddp, zero1): each parameter's place is a view made once;
    the first grad is copied in, later ones add. got_grad and expected are
    sets of parameters kept by index; missing() is the expected ones with no grad."""
    a, b, c, frozen = torch.zeros(2), torch.zeros(3), torch.zeros(1), torch.zeros(1)
    bucket, later = buckets_from_runs([[a, b], [c]])
    flat = torch.zeros(6)
    buckets = Buckets([bucket, later], torch.float32, torch.device("cpu"), flat=flat)
    assert buckets.indices([c, frozen, a]) == [2, 0]  # in the order given; a frozen one has none
    buckets.forward_uses(buckets.indices([a, b, c]), True)
    buckets.forward_uses(buckets.indices([a]), False)  # a use that is not expected: a has two uses
    assert buckets.add(b, torch.ones(3)) == []
    assert buckets.add(a, torch.full((2,), 2.0)) == []  # a's second use is still to come
    assert buckets.add(a, torch.full((2,), 3.0)) == [bucket]
    assert torch.equal(flat, torch.tensor([5.0, 5.0, 1.0, 1.0, 1.0, 0.0]))
    assert a in buckets.got_grad and c not in buckets.got_grad and frozen not in buckets.got_grad
    assert list(buckets.got_grad) == [a, b] and len(buckets.got_grad) == 2
    assert buckets.missing() == [c] and c in buckets.expected
    buckets.got_grad.discard(a)
    buckets.got_grad.discard(frozen)  # not in the buckets: nothing to do, as a set's discard
    assert list(buckets.got_grad) == [b]
    assert buckets.missing() == [a, c]
    buckets.end_backward()
    buckets.clear()
    assert not buckets.got_grad and not buckets.expected and not flat.any()
