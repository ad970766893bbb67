"""tiny_zero equals its peers: every strategy's losses, clip norms and
parameters match torch DDP's, FSDP2's and DeepSpeed ZeRO stage 1/2/3's at
rtol 1e-5 / atol 1e-6, in fp32 on 2 ranks, over 6 AdamW steps with plain
AdamW, eps=1, gradient clipping and gradient accumulation (peer_checks.py).
And the benchmark's memory tracker (example/benchmark/peers.py) splits each
peer's peak into what that peer is known to hold.

One spawned world runs everything. DeepSpeed runs on CPU with gloo; without
it, its tests are skipped with the reason (pip install -e ".[test]" brings it).
"""
import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import run_world  # noqa: E402

MODES = ["plain", "eps1", "clip", "no_sync"]
DEEPSPEED = ["deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
MEMORY_RUNS = ["zero1", "torch_fsdp2"] + (["deepspeed_zero1", "deepspeed_zero3"] if HAS_DEEPSPEED else [])


@pytest.fixture(scope="module")
def world2():
    peers = ["torch_ddp", "torch_fsdp2"] + (DEEPSPEED if HAS_DEEPSPEED else [])
    return run_world(2, "peer_checks", "everything", peers, MODES, MEMORY_RUNS)


def check(world2, peer):
    for rank in (r["parity"] for r in world2):
        if peer in rank["skipped"]:
            pytest.skip(rank["skipped"][peer])
        failures = rank["failures"][peer]
        assert not failures, "\n".join(failures[:40])


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["torch_ddp", "torch_fsdp2"])
def test_torch_peers_match_tiny_zero(peer, world2):
    check(world2, peer)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install deepspeed)")
@pytest.mark.parametrize("peer", DEEPSPEED)
def test_deepspeed_matches_tiny_zero(peer, world2):
    check(world2, peer)


@pytest.mark.slow
def test_benchmark_splits_each_peak_by_what_holds_it(world2):
    """example/benchmark/peers.py's tracker on 2 ranks, fp32: each part of the
    peak is what the peer is known to hold (Ψ parameters, within padding)."""
    n, results = world2[0]["memory"]
    share = 4 * n / 2  # fp32 bytes of half the parameters

    def near(bytes_, expected):
        return abs(bytes_ - expected) <= 0.01 * expected + 1024

    for name, r in results.items():
        parts = r["parts"]
        assert sum(parts.values()) == r["peak"] and min(parts.values()) >= 0, (name, parts)
        assert near(parts["optimizer state"], 2 * share), (name, parts)  # exp_avg + exp_avg_sq of the half
    assert near(results["zero1"]["parts"]["parameters"], 2 * share)  # every parameter, once
    assert results["zero1"]["parts"]["fp32 master copy"] == 0  # fp32: the optimizer steps views of the params
    assert near(results["torch_fsdp2"]["parts"]["parameters"], share)  # its DTensor shards
    if "deepspeed_zero1" in results:
        ds1, ds3 = results["deepspeed_zero1"]["parts"], results["deepspeed_zero3"]["parts"]
        assert near(ds1["parameters"], 2 * share) and near(ds1["fp32 master copy"], share), ds1
        assert near(ds3["parameters"], share) and near(ds3["fp32 master copy"], share), ds3
        # its gradient bucket: reduce_bucket_size elements, allocated whatever the model's size
        assert ds1["transient"] >= 25 * 2**20 and ds3["other kept buffers"] >= 25 * 2**20, (ds1, ds3)


def test_benchmark_runs_each_strategy_beside_its_peer_in_turn():
    """peers.py's default order puts each tiny_zero strategy right before the
    peer its time is held to, and every other repeat runs the order backwards."""
    from example.benchmark import peers
    order = peers.paired_order()
    assert sorted(order) == sorted(peers.RUNS)
    for ours, matches in peers.MATCHES.items():
        (timed,) = [peer for peer, limit in matches.items() if limit is not None]
        assert order.index(timed) == order.index(ours) + 1, (ours, timed, order)
    assert peers.in_turn(order, 0) == order == peers.in_turn(order, 2)
    assert peers.in_turn(order, 1) == order[::-1]
