"""Requests move end to end in one process, every byte checked.

Byte placement differs by engine layout, so a transfer between two layouts is checked by a
round trip: context ranks in layout A (tp 2) -> a generation rank in layout B (tp 1), then B
acting as the sender -> fresh receivers in layout A (tp 2), whose pages must hold what the
context ranks sent (pages.expect_arrived). A transfer between equal layouts at equal tp is
checked directly: the generation pages must hold the context pages' bytes.
"""

import socket
import time

import numpy as np
import pytest
import torch

import hxfer
from pages import (NUM_BLOCKS, NUM_SLOTS, Released, expect_arrived, fill, gather, numpy_pools,
                   scatter, tiny_layout, wait_until)


def return_trip(A, P, B, gen_mem, request_id, num_tokens, gen_pages, back_pages, **transport):
    """Sends request `request_id` back from generation layout B (tp 1, its pages `gen_pages` in
    `gen_mem`) into fresh pools of the context layouts A; checks them against the patterns P the
    context ranks sent. Returns the bytes that came back."""
    check = [numpy_pools(a) for a in A]
    for r, a in enumerate(A):
        scatter(a, check[r], *back_pages, ~P[r])
    moved = 0
    with hxfer.Sender(B, gen_mem, **transport) as back:
        receivers = [hxfer.Receiver(a, hxfer.Memory(a, check[r]), peers=[back.address],
                                    peer_tp=1, instance="back", **transport)
                     for r, a in enumerate(A)]
        back.mark_ready(request_id, gen_pages[0], gen_pages[1], aux=b"back")
        for r, rx in enumerate(receivers):
            rx.start(request_id, num_tokens, *back_pages)
            res = rx.wait(request_id, timeout=30.0)
            assert res.ok, res.error
            assert res.aux == b"back"
            moved += expect_arrived(gather(A[r], check[r], *back_pages), P[r], res.bytes,
                                    f"{A[r]} after the round trip")
            rx.release(request_id)
            rx.shutdown()
    return moved


def test_documented_snippet_moves_sglang_tp2_state_into_a_trtllm_v2_rank_and_back_byte_exact():
    # The snippet of docs/api.md, verbatim but for the loop over the two context ranks.
    addrs, senders, ctx_layouts, ctx_pools = [], [], [], []
    for rank in range(2):
        lay = hxfer.Layout.engine("sglang", model="nemotron-h-8b", tp=2, tp_rank=rank, pp=1,
                                  pp_rank=0, num_blocks=64, num_slots=8, tokens_per_block=32,
                                  kv_dtype="bf16", conv_dtype="bf16", ssm_dtype="fp32")
        pools = lay.pools()
        bufs = {p["name"]: np.zeros(p["bytes"], np.uint8) for p in pools}
        mem = hxfer.Memory(lay, bufs)
        tx = hxfer.Sender(lay, mem, listen="127.0.0.1:0", backend="auto", instance="ctx")
        ctx_layouts.append(lay)
        ctx_pools.append(bufs)
        senders.append(tx)
        addrs.append(tx.address)
    P = [fill(lay, ctx_pools[r], [3, 4], 1, 2024, 7, r) for r, lay in enumerate(ctx_layouts)]
    for tx in senders:
        tx.mark_ready(7, blocks=[3, 4], slot=1, aux=b"tok")

    gen_lay = hxfer.Layout.engine("trtllm-v2", model="nemotron-h-8b", num_blocks=16, num_slots=4,
                                  kv_dtype="bf16", conv_dtype="bf16", ssm_dtype="fp32")
    gen_bufs = numpy_pools(gen_lay)
    gen_mem = hxfer.Memory(gen_lay, gen_bufs)
    addr_rank0, addr_rank1 = addrs
    rx = hxfer.Receiver(gen_lay, gen_mem, peers=[addr_rank0, addr_rank1], backend="auto")
    assert rx.backend == "ucx"
    rx.start(7, num_tokens=60, blocks=[0, 9], slot=2)
    r = rx.wait(7, timeout=30.0)
    assert (r.ok, r.state, r.error, r.code) == (True, "done", None, "OK")
    assert r.aux == b"tok"
    assert r.bytes > 0 and r.latency > 0
    rx.release(7)
    assert not rx.holds(7)
    rx.shutdown()
    for tx in senders:
        assert wait_until(lambda: not tx.holds(7))
        tx.shutdown()

    back = return_trip(ctx_layouts, P, gen_lay, gen_mem, 7, 60, ([0, 9], 2), ([5, 6], 3),
                       backend="inproc")
    assert back == r.bytes


ROUND_TRIPS = [
    # (context engine and options, generation engine and options, tokens)
    (("vllm", {}), ("trtllm-v2", {}), 64),
    (("trtllm-v2", {"kv_layout": "nhd"}), ("sglang", {}), 60),
    (("sglang", {}), ("vllm", {"kv_layout": "hnd", "conv_layout": "ds"}), 96),
    (("hxfer", {"state_layout": "layer-major"}), ("trtllm-v1", {}), 33),
]


@pytest.mark.parametrize("ctx,gen,tokens", ROUND_TRIPS,
                         ids=[f"{c[0]}-to-{g[0]}-{t}tokens" for c, g, t in ROUND_TRIPS])
def test_round_trip_between_engine_layouts_at_tp2_and_tp1_returns_every_byte(ctx, gen, tokens):
    A = [tiny_layout(ctx[0], tp=2, tp_rank=r, **ctx[1]) for r in range(2)]
    B = tiny_layout(gen[0], **gen[1])
    n = A[0].blocks_for(tokens)
    # sglang's page 0 is the engine's dummy: no request names it.
    ctx_pages = (list(range(9, 9 + n))[::-1], 4)
    gen_pages = (list(range(2, 2 + n)), 5)
    back_pages = (list(range(12, 12 + n)), 0)
    src = [numpy_pools(a) for a in A]
    P = [fill(a, src[r], *ctx_pages, 11, r) for r, a in enumerate(A)]
    ctx_released, gen_released = Released(), Released()
    senders = [hxfer.Sender(a, hxfer.Memory(a, src[r]), backend="inproc", instance="ctx",
                            on_released=ctx_released) for r, a in enumerate(A)]
    for tx in senders:
        tx.mark_ready(1, *ctx_pages)
    gen_mem = hxfer.Memory(B, numpy_pools(B))
    with hxfer.Receiver(B, gen_mem, peers=[tx.address for tx in senders], backend="inproc",
                        on_released=gen_released) as rx:
        rx.wait_for_peers(timeout=10.0)
        rx.start(1, tokens, *gen_pages)
        res = rx.wait(1, timeout=30.0)
        assert res.ok, res.error
        rx.release(1)
        assert gen_released.wait_for(1)
    assert wait_until(lambda: ctx_released.count(1) == 2)
    for tx in senders:
        tx.shutdown()
    assert return_trip(A, P, B, gen_mem, 1, tokens, gen_pages, back_pages,
                       backend="inproc") == res.bytes


def buffers_of(kind, layout):
    if kind == "numpy":
        return numpy_pools(layout)
    if kind == "bytearray":
        return {p["name"]: bytearray(p["bytes"]) for p in layout.pools()}
    if kind == "memoryview":
        return {p["name"]: memoryview(bytearray(p["bytes"])) for p in layout.pools()}
    if kind == "torch":
        return {p["name"]: torch.zeros(p["bytes"], dtype=torch.uint8) for p in layout.pools()}
    if kind == "shared":
        return {p["name"]: hxfer.SharedBuffer(p["bytes"], p["name"]) for p in layout.pools()}
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["numpy", "bytearray", "memoryview", "torch", "shared"])
def test_memory_from_each_buffer_kind_moves_a_request_byte_for_byte(kind):
    # Same layout and tp on both sides: the generation records equal the context records.
    lay = tiny_layout("trtllm-v2")
    src, dst = buffers_of(kind, lay), buffers_of(kind, lay)
    P = fill(lay, src, [1, 2], 3, 5, kind.encode()[0])
    scatter(lay, dst, [7, 8], 0, ~P)
    with hxfer.Sender(lay, hxfer.Memory(lay, src), backend="inproc") as tx, \
            hxfer.Receiver(lay, hxfer.Memory(lay, dst), peers=[tx.address],
                           backend="inproc") as rx:
        tx.mark_ready(3, [1, 2], 3)
        rx.start(3, 64, [7, 8], 0)
        res = rx.wait(3, timeout=30.0)
        assert res.ok, res.error
        got = gather(lay, dst, [7, 8], 0)
        assert expect_arrived(got, P, res.bytes) == len(P)  # trtllm-v2 records have no padding
        np.testing.assert_array_equal(got, P)
        rx.release(3)


def test_memory_keeps_its_buffers_alive_after_the_caller_drops_them():
    lay = tiny_layout("trtllm-v2")
    src = numpy_pools(lay)
    P = fill(lay, src, [1], 2, 9)
    mem = hxfer.Memory(lay, src)
    views = {name: buf for name, buf in src.items()}
    del src
    assert set(mem.buffers) == set(views)
    del views  # only the Memory holds the arrays now
    dst = numpy_pools(lay)
    scatter(lay, dst, [4], 1, ~P)
    with hxfer.Sender(lay, mem, backend="inproc") as tx, \
            hxfer.Receiver(lay, hxfer.Memory(lay, dst), peers=[tx.address],
                           backend="inproc") as rx:
        del mem
        tx.mark_ready(1, [1], 2)
        rx.start(1, 32, [4], 1)
        res = rx.wait(1, timeout=30.0)
        assert res.ok, res.error
        np.testing.assert_array_equal(gather(lay, dst, [4], 1), P)


def test_metrics_count_requests_bytes_and_held_pages():
    lay = tiny_layout("hxfer")
    with hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc") as tx, \
            hxfer.Receiver(lay, hxfer.Memory(lay, numpy_pools(lay)), peers=[tx.address],
                           backend="inproc") as rx:
        before = rx.metrics()
        assert isinstance(before, dict)
        assert before["requests_ok"] == 0 and before["requests_held"] == 0
        for i in range(3):
            tx.mark_ready(i, [i], i)
            assert tx.metrics()["requests_held"] == 1
            rx.start(i, 32, [i + 4], i)
            assert rx.wait(i, timeout=30.0).ok
            assert rx.metrics()["requests_held"] == 1
            rx.release(i)
            assert wait_until(lambda: tx.metrics()["requests_held"] == 0)
        after = rx.metrics()
        assert after["requests_ok"] == 3 and after["requests_started"] == 3
        assert after["bytes"] > before["bytes"]
        assert after["requests_held"] == 0
        assert after["latency_p50_us"] > 0
        assert tx.metrics()["requests_ok"] == 3


def test_poll_reports_progress_and_result_latency_in_seconds():
    lay = tiny_layout("trtllm-v2")
    with hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc") as tx, \
            hxfer.Receiver(lay, hxfer.Memory(lay, numpy_pools(lay)), peers=[tx.address],
                           backend="inproc") as rx:
        rx.wait_for_peers(timeout=10.0)
        rx.start(9, 20, [0], 1, aux=b"prompt")
        first = rx.poll(9)
        assert first.state == "in_progress" and not first.terminal and not first.ok
        tx.mark_ready(9, [5], 2, aux=bytearray(b"x" * 4096))
        res = rx.wait(9, timeout=30.0)
        assert res.ok and bool(res)
        assert res.aux == b"x" * 4096
        assert 0 < res.latency < 30
        assert rx.poll(9).state == "done"
        rx.release(9)
        with pytest.raises(hxfer.Error) as e:
            rx.poll(9)
        assert e.value.code == "NotFound"


def test_block_arrays_from_numpy_and_ranges_are_accepted():
    lay = tiny_layout("trtllm-v2")
    with hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc") as tx, \
            hxfer.Receiver(lay, hxfer.Memory(lay, numpy_pools(lay)), peers=[tx.address],
                           backend="inproc") as rx:
        tx.mark_ready(1, np.array([3, 4], dtype=np.int64), np.int32(1))
        rx.start(1, 64, range(5, 7), slot=np.uint8(2))
        assert rx.wait(1, timeout=30.0).ok
        rx.release(1)


def test_layout_describes_pools_and_compares_by_value():
    lay = tiny_layout("sglang", tp=2, tp_rank=1)
    assert lay.has_kv and lay.has_state
    assert lay.blocks_for(60) == 2 and lay.blocks_for(0) == 0
    assert "sglang" in lay.describe() and "tp=2 rank 1" in lay.describe()
    assert repr(lay) == f"hxfer.Layout({lay.describe()})"
    pools = lay.pools()
    assert {p["name"] for p in pools} >= {"conv0", "ssm0"}
    for p in pools:
        assert set(p) == {"name", "bytes", "shape", "strides"}
        assert max(n * s for n, s in zip(p["shape"], p["strides"])) == p["bytes"]
        assert lay.pool(p["name"]) == p
    assert lay.pool("nonesuch") is None
    assert lay == tiny_layout("sglang", tp=2, tp_rank=1)
    assert lay != tiny_layout("sglang", tp=2, tp_rank=0)
    assert lay != "sglang"
    assert (lay.num_blocks, lay.num_slots, lay.tokens_per_block) == (NUM_BLOCKS, NUM_SLOTS, 32)
    import pickle
    assert pickle.loads(pickle.dumps(lay)) == lay


def test_module_exposes_version_and_api_version():
    assert isinstance(hxfer.__version__, str)  # its value: test_package.py
    assert isinstance(hxfer.API_VERSION, int) and hxfer.API_VERSION >= 1
    assert issubclass(hxfer.Error, Exception)


def test_shared_buffer_is_a_zero_copy_writable_uint8_buffer():
    sb = hxfer.SharedBuffer(4096, name="kv0")
    assert sb.nbytes == 4096 and len(sb) == 4096 and sb.fd >= 0
    a = np.frombuffer(sb, np.uint8)
    b = np.asarray(sb)
    assert a.dtype == np.uint8 and a.shape == (4096,) and a.flags.writeable
    a[10] = 42
    assert b[10] == 42 and memoryview(sb)[10] == 42
    del sb  # the numpy views keep it alive
    a[11] = 7
    assert b[11] == 7


def test_auto_backend_picks_ucx_for_numpy_pools_and_shm_for_shared_buffers_saying_why():
    lay = tiny_layout("hxfer")
    with hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), listen="127.0.0.1:0") as tx:
        assert tx.backend == "ucx"
        assert "private memory" in tx.routing
        assert tx.address.startswith("ucx:127.0.0.1:")
    shared = hxfer.Memory(lay, buffers_of("shared", lay))
    assert shared.shareable
    assert not hxfer.Memory(lay, numpy_pools(lay)).shareable
    with hxfer.Sender(lay, shared, listen="127.0.0.1:0") as tx:
        assert tx.backend == "shm", tx.routing
        assert tx.address.startswith("shm:")
        gen = hxfer.Memory(lay, buffers_of("shared", lay))
        with hxfer.Receiver(lay, gen, peers=[tx.address]) as rx:
            assert rx.backend == "shm", rx.routing
        # Private memory cannot take shm peers, and says so.
        with pytest.raises(hxfer.Error) as e:
            hxfer.Receiver(lay, hxfer.Memory(lay, numpy_pools(lay)), peers=[tx.address])
        assert e.value.code == "InvalidArgument" and "shareable" in e.value.message


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_result_queued_is_the_wait_for_the_context_rank_within_latency():
    lay = tiny_layout("vllm")
    src, dst = numpy_pools(lay), numpy_pools(lay)
    P = fill(lay, src, [1], 1, 3, 3)
    scatter(lay, dst, [3], 3, ~P)
    port = free_port()
    with hxfer.Receiver(lay, hxfer.Memory(lay, dst), peers=[f"ucx:127.0.0.1:{port}"],
                        backend="ucx") as rx:
        rx.start(1, 32, [3], 3)  # its context rank is not up yet: the ask waits
        time.sleep(0.5)
        with hxfer.Sender(lay, hxfer.Memory(lay, src), listen=f"127.0.0.1:{port}",
                          backend="ucx") as tx:
            tx.mark_ready(1, [1], 1)
            res = rx.wait(1, timeout=30.0)
            assert res.ok, res.error
            expect_arrived(gather(lay, dst, [3], 3), P, res.bytes)
            rx.release(1)
    assert 0.5 <= res.queued <= res.latency, (res.queued, res.latency)
    assert res.latency - res.queued < 0.5, (res.queued, res.latency)
    # Never asked (nobody listens there): all of its latency was queued.
    with hxfer.Receiver(lay, hxfer.Memory(lay, dst), peers=[f"ucx:127.0.0.1:{free_port()}"],
                        backend="ucx", request_timeout=0.3) as rx:
        rx.start(2, 32, [3], 3)
        res = rx.wait(2, timeout=30.0)
    assert res.code == "Timeout", res.error
    assert res.queued == res.latency > 0, (res.queued, res.latency)


def test_checksummed_transfer_with_a_token_counts_the_connected_peer():
    lay = tiny_layout("vllm")
    src, dst = numpy_pools(lay), numpy_pools(lay)
    P = fill(lay, src, [6], 1, 3, 3)
    scatter(lay, dst, [2], 4, ~P)
    with hxfer.Sender(lay, hxfer.Memory(lay, src), backend="inproc", token="s3cret",
                      instance="prefill-a", checksum=True) as tx, \
            hxfer.Receiver(lay, hxfer.Memory(lay, dst), peers=[tx.address], backend="inproc",
                           token="s3cret", instance="decode-b", checksum=True) as rx:
        rx.wait_for_peers(timeout=10.0)
        assert tx.connected_peers() == 1
        tx.mark_ready(1, [6], 1)
        rx.start(1, 32, [2], 4)
        res = rx.wait(1, timeout=30.0)
        assert res.ok, res.error
        expect_arrived(gather(lay, dst, [2], 4), P, res.bytes)
        rx.release(1)


def test_receiver_with_the_wrong_token_is_refused_with_permission_denied():
    lay = tiny_layout("trtllm-v2")
    with hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc",
                      token="right") as tx, \
            hxfer.Receiver(lay, hxfer.Memory(lay, numpy_pools(lay)), peers=[tx.address],
                           backend="inproc", token="wrong") as rx:
        with pytest.raises(hxfer.Error) as e:
            rx.wait_for_peers(timeout=5.0)
        assert e.value.code == "PermissionDenied" and "token" in e.value.message
        assert tx.connected_peers() == 0


def test_streamed_layers_land_before_the_last_is_ready_and_the_request_ends_with_it():
    lay = tiny_layout("hxfer")
    ctx_pools, gen_pools = numpy_pools(lay), numpy_pools(lay)
    ctx_pages, gen_pages = ([1, 2, 3], 1), ([4, 5, 6], 2)
    sent = fill(lay, ctx_pools, *ctx_pages, 5, 17)
    scatter(lay, gen_pools, *gen_pages, ~sent)
    first, end = lay.stage_layers
    assert (first, end) == (0, 8)  # tiny-hybrid: 8 layers, 2 of them without a cache
    with hxfer.Sender(lay, hxfer.Memory(lay, ctx_pools), backend="inproc",
                      stream_min_tokens=0) as tx, \
            hxfer.Receiver(lay, hxfer.Memory(lay, gen_pools), peers=[tx.address],
                           backend="inproc") as rx:
        rx.wait_for_peers(timeout=10.0)
        rx.start(17, 96, *gen_pages)
        assert wait_until(lambda: tx.metrics()["requests_started"] == 1)
        tx.mark_ready(17, *ctx_pages, layers=(first, 4))
        # The first layers' bytes arrive while the request is still in progress.
        assert wait_until(lambda: int((gather(lay, gen_pools, *gen_pages) == sent).sum()) > 0)
        assert rx.poll(17).state == "in_progress"
        with pytest.raises(hxfer.Error) as e:
            tx.mark_ready(17, [1, 2, 7], 1, layers=(4, 6))
        assert e.value.code == "InvalidArgument" and "other pages" in str(e.value)
        with pytest.raises(hxfer.Error) as e:
            tx.mark_ready(17, *ctx_pages, layers=(5, 6))
        assert "leaves layers [4, 5) not ready" in str(e.value)
        with pytest.raises(ValueError):
            tx.mark_ready(17, *ctx_pages, layers=(-1, 6))
        tx.mark_ready(17, *ctx_pages, layers=(4, end), aux=b"tok")
        res = rx.wait(17, timeout=30.0)
        assert res.ok, res.error
        assert res.aux == b"tok"
        expect_arrived(gather(lay, gen_pools, *gen_pages), sent, res.bytes, "streamed request")
        rx.release(17)
        assert wait_until(lambda: not tx.holds(17))


def _record_bytes(layout, buffers, pages):
    """The bytes of every record of the request's pages, found through Layout.records(): kv by
    block, state by the id of the record's state_group (pages = (blocks, slot, group_slots))."""
    blocks, slot, group_slots = pages
    state_ids = [slot] + list(group_slots)
    out = []
    for layer in layout.layers():
        for role in ("kv", "conv", "ssm"):
            try:
                parts = layout.records(layer, role)
            except hxfer.Error as e:
                assert e.code == "NotFound", str(e)
                continue
            for part in parts:
                mem = buffers[part["pool"]]
                span = part["element_bytes"] + sum((d["size"] - 1) * d["stride"]
                                                   for d in part["dims"])
                indices = blocks if role == "kv" else [state_ids[part["state_group"]]]
                for i in indices:
                    at = part["offset"] + i * part["index_stride"]
                    out.append(mem[at:at + span].copy())
    return np.concatenate(out)


def test_vllm_shared_tensors_move_a_request_with_a_state_id_per_group_byte_exact():
    # vLLM's hybrid manager: one tensor per layer of every KV cache group, blocks and states
    # from one pool, one state id per group of Mamba layers (tiny-hybrid: two groups).
    lay = tiny_layout("vllm", shared_tensors="on")
    assert lay.joint_ids and lay.state_groups == 2
    assert [p["name"] for p in lay.pools()] == ["shared.0", "shared.1"]
    ctx_bufs = numpy_pools(lay)
    for b in ctx_bufs.values():
        b[:] = np.random.default_rng(5).integers(0, 256, b.size, dtype=np.uint8)
    gen_bufs = numpy_pools(lay)
    ctx_pages, gen_pages = ([4, 9], 2, [11]), ([0, 7], 12, [3])
    with hxfer.Sender(lay, hxfer.Memory(lay, ctx_bufs), backend="inproc") as tx:
        with hxfer.Receiver(lay, hxfer.Memory(lay, gen_bufs), peers=[tx.address],
                            backend="inproc") as rx:
            with pytest.raises(hxfer.Error, match="0 group slots given besides the slot"):
                tx.mark_ready(1, blocks=[4, 9], slot=2)
            tx.mark_ready(1, blocks=ctx_pages[0], slot=ctx_pages[1], group_slots=ctx_pages[2])
            rx.start(1, 64, blocks=gen_pages[0], slot=gen_pages[1], group_slots=gen_pages[2])
            res = rx.wait(1, timeout=30.0)
            assert res.ok, res.error
            # Two whole blocks: every byte of every record arrived, each state in its group's
            # page, and nothing else was written (the rest of the pools is still zero).
            sent = _record_bytes(lay, ctx_bufs, ctx_pages)
            got = _record_bytes(lay, gen_bufs, gen_pages)
            assert res.bytes == got.size
            assert np.array_equal(got, sent)
            assert sum(int(np.count_nonzero(b)) for b in gen_bufs.values()) == \
                np.count_nonzero(sent)
            rx.release(1)
