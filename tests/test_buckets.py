"""tiny_zero.buckets.Buckets. Without a flat buffer (zero2, zero3, fsdp, offload),
a bucket holds the grads made so far, apart, and becomes one flat buffer only
when it is handed out to be sent; with one (ddp, zero1), each parameter's
place in it is a view made once. What a step tracks per parameter is kept
by its index."""
import torch

from tiny_zero.buckets import Buckets, buckets_from_runs


def test_a_bucket_is_flattened_when_sent_and_holds_only_what_was_made_before():
    a, b, c = torch.zeros(3), torch.zeros(2, 2), torch.zeros(5)
    bucket, later = buckets_from_runs([[a, b], [c]], pad_to=4)
    buckets = Buckets([bucket, later], torch.float32, torch.device("cpu"))
    buckets.forward_uses(buckets.indices([a, b, c]), False)
    buckets.forward_uses(buckets.indices([b]), False)  # b is used twice: two grad contributions

    assert buckets.add(b, torch.full((2, 2), 1.0)) == []
    assert bucket.grads is None and set(bucket.parts) == {buckets.index[id(b)]}  # b's part; no flat buffer yet
    assert buckets.add(a, torch.arange(3.0)) == []  # b still has a use to come
    assert bucket.grads is None
    sent = buckets.add(b, torch.full((2, 2), 2.0))
    assert sent == [bucket] and bucket.parts == {}
    assert bucket.numel == 8  # 7 padded to 4
    assert torch.equal(bucket.grads, torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 3.0, 3.0, 0.0]))
    assert later.grads is None and later.parts == {}  # c got no grad: nothing made for it


def test_clear_drops_the_parts():
    a, b = torch.zeros(2), torch.zeros(2)
    (bucket,) = buckets_from_runs([[a, b]])
    buckets = Buckets([bucket], torch.float32, torch.device("cpu"))
    buckets.forward_uses(buckets.indices([a, b]), False)
    buckets.add(a, torch.ones(2))
    buckets.clear()
    assert bucket.parts == {} and bucket.grads is None and not buckets.got_grad


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
