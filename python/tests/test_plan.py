"""hxfer.plan_transfer: a request's fragments for an engine (or a benchmark) that moves the bytes
itself, and the peers benchmark harness built on it (bench/peers/peers.py) with the systems
that need no extra package.

The fragments are checked against hxfer itself: run with numpy, they must leave the generation
pools byte for byte as a Sender -> Receiver transfer of the same request leaves them.
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import hxfer
from pages import Released, fill, numpy_pools, tiny_layout

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_fragments(plan, sources, src_pools, destination, dst_pools):
    src_names = [[p["name"] for p in s.pools()] for s in sources]
    dst_names = [p["name"] for p in destination.pools()]
    for src, sp, so, dp, do, n in plan["fragments"].tolist():
        dst_pools[dst_names[dp]][do:do + n] = src_pools[src][src_names[src][sp]][so:so + n]


@pytest.mark.parametrize("ctx_engine,gen_engine", [
    ({"engine": "vllm", "conv_layout": "ds"}, {"engine": "sglang"}),
    ({"engine": "trtllm-v2", "kv_layout": "nhd"}, {"engine": "hxfer"}),
])
def test_fragments_write_what_a_sender_writes(ctx_engine, gen_engine):
    ctx_options, gen_options = dict(ctx_engine), dict(gen_engine)
    ctx_name, gen_name = ctx_options.pop("engine"), gen_options.pop("engine")
    A = [tiny_layout(ctx_name, tp=2, tp_rank=r, **ctx_options) for r in range(2)]
    B = tiny_layout(gen_name, **gen_options)
    tokens, blocks, slot = 60, [9, 2], 3
    ctx_pools = [numpy_pools(a) for a in A]
    for r, a in enumerate(A):
        fill(a, ctx_pools[r], [5, 11], 1, 4, r)
    # Context ranks listed in reverse: fragments say which source they read.
    plan = hxfer.plan_transfer(A[::-1], [([5, 11], 1)] * 2, B, (blocks, slot), tokens)
    frags = plan["fragments"]
    assert frags.dtype == np.uint64 and frags.shape[1] == 6 and len(frags) > 0
    assert int(frags[:, 5].sum()) == plan["bytes"]
    assert set(frags[:, 0].tolist()) == {0, 1}

    by_plan = numpy_pools(B)
    run_fragments(plan, A[::-1], ctx_pools[::-1], B, by_plan)

    by_hxfer = numpy_pools(B)
    released = Released()
    senders = [hxfer.Sender(a, hxfer.Memory(a, ctx_pools[r]), backend="inproc", instance="ctx",
                            on_released=released) for r, a in enumerate(A)]
    with hxfer.Receiver(B, hxfer.Memory(B, by_hxfer), peers=[s.address for s in senders],
                        peer_tp=2, backend="inproc") as rx:
        for s in senders:
            s.mark_ready(1, [5, 11], 1)
        rx.start(1, tokens, blocks, slot)
        res = rx.wait(1, timeout=30.0)
        assert res.ok, res.error
        assert res.bytes == plan["bytes"]
        rx.release(1)
    for s in senders:
        s.shutdown()
    for name in by_plan:
        assert np.array_equal(by_plan[name], by_hxfer[name]), name


def test_plan_errors_name_the_field_and_value():
    a = tiny_layout("vllm")
    ds = tiny_layout("vllm", conv_layout="ds")
    with pytest.raises(hxfer.Error) as e:
        hxfer.plan_transfer([a], [([1, 2], 0)], ds, ([3, 4], 1), 60)
    assert e.value.code == "Incompatible" and "staging" in e.value.message
    with pytest.raises(hxfer.Error) as e:
        hxfer.plan_transfer([a], [([1, 2], 0)], a, ([3], 1), 60)
    assert e.value.code == "InvalidArgument" and "60 tokens need 2" in e.value.message
    with pytest.raises(hxfer.Error) as e:
        hxfer.plan_transfer([a], [([1, 2], None)], a, ([3, 4], 1), 60)
    assert "source 0" in e.value.message and "slot" in e.value.message
    with pytest.raises(TypeError, match="destination_pages"):
        hxfer.plan_transfer([a], [([1, 2], 0)], a, [3, 4], 60)


def test_peers_harness_runs_and_checks_every_request_without_the_peers(tmp_path):
    """The harness's own path (two processes, hxfer over shm and ucx, the baselines), on the
    latency workload: every run verified, nothing held after."""
    out = tmp_path / "peers.json"
    cmd = [sys.executable, str(ROOT / "bench" / "peers" / "peers.py"), "--workloads",
           "latency", "--systems", "hxfer-shm,hxfer-ucx,memcpy,tcp", "--latency-rounds", "4",
           "--warmup", "1", "--json", str(out), "--plot", str(tmp_path / "peers.svg")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == {"hxfer-shm", "hxfer-ucx", "memcpy", "tcp"}
    for s in ("hxfer-shm", "hxfer-ucx"):
        assert rows[s]["verified"] == rows[s]["runs"] == 4
        assert rows[s]["requests_held"] == [0, 0]
    assert rows["memcpy"]["bytes"] == rows["hxfer-shm"]["bytes"] > 0
    assert result["ratios"][0]["workload"] == "latency-1block"
    assert (tmp_path / "peers.svg").read_text().startswith("<svg")
