"""hxfer.vllm's checks that need vLLM importable but no running instance: the configuration it
refuses (naming the key and what it expects), the tensors it refuses to describe, and its
transfer statistics in NixlConnector's units. Seconds, not minutes: run before the pairs."""
import dataclasses
import types

import pytest

hv = pytest.importorskip("hxfer.vllm", reason="hxfer's vLLM connector does not import here")
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("extra,words", [
    ({"bogus": 1}, ["unknown keys ['bogus']", "known:"]),
    ({"test_corrupt_after_load": "ssm"}, ["'test_corrupt_after_load'", "'ssm'", "mamba_page"]),
    ({"backend": "rdma"}, ["['backend']='rdma'", "auto, ucx or shm"]),
    ({"port": 70000}, ["['port']=70000", "0..65535"]),
    ({"port": "8100"}, ["['port']='8100'"]),
    ({"lease_timeout": 0}, ["['lease_timeout']=0", "seconds > 0"]),
    ({"request_timeout": "30"}, ["['request_timeout']='30'"]),
    ({"stall_timeout": -1}, ["['stall_timeout']=-1", "seconds > 0"]),
    ({"ucx_options": "TLS=tcp"}, ["['ucx_options']='TLS=tcp'", "a dict"]),
    ({"ucx_options": {"TLS": None}}, ["['ucx_options']={'TLS': None}", "strings or numbers"]),
    ({"checksum": "false"}, ["['checksum']='false'", "true or false"]),
    ({"token": 1234}, ["['token']=1234", "a string"]),
    ({"host": ["10.0.0.1"]}, ["['host']=['10.0.0.1']", "a string"]),
])
def test_bad_extra_config_is_refused_naming_key_and_value(extra, words):
    with pytest.raises(ValueError) as e:
        hv._Options.parse(extra)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_empty_extra_config_takes_the_documented_defaults(monkeypatch):
    monkeypatch.delenv("HXFER_TOKEN", raising=False)
    monkeypatch.delenv("HXFER_HOST", raising=False)
    o = hv._Options.parse({})
    assert (o.backend, o.host, o.port, o.token, o.corrupt) == ("auto", "127.0.0.1", 0, "", None)
    assert (o.lease_timeout, o.request_timeout, o.stall_timeout, o.handshake_timeout) == (
        120.0, 30.0, 30.0, 10.0)
    monkeypatch.setenv("HXFER_TOKEN", "s3cret")
    monkeypatch.setenv("HXFER_HOST", "10.0.0.5")
    o = hv._Options.parse({})
    assert (o.token, o.host) == ("s3cret", "10.0.0.5")


def _attention_spec(block_size=16, heads=2, head_size=32, dtype=torch.float32):
    return types.SimpleNamespace(block_size=block_size, num_kv_heads=heads, head_size=head_size,
                                 dtype=dtype)


def test_attention_view_other_than_the_cpu_backends_is_refused_naming_the_layer():
    spec = _attention_spec()
    buf = torch.zeros(4 * 2 * 16 * 64, dtype=torch.float32)
    base = buf.untyped_storage().data_ptr()
    good = buf.view(4, 2, 16, 64)
    recs = hv._attention_records(3, good, spec, "vec", "kv", base)
    assert [r["role"] for r in recs] == ["kv", "kv"]
    with pytest.raises(ValueError, match=r"layer 3 is \[4, 2, 8, 128\]"):
        hv._attention_records(3, buf.view(4, 2, 8, 128), spec, "vec", "kv", base)
    with pytest.raises(ValueError, match="ISA 'neon' is not described"):
        hv._attention_records(3, good, spec, "neon", "kv", base)
    with pytest.raises(ValueError, match="strides"):
        hv._attention_records(3, buf.view(4, 16, 2, 64).transpose(1, 2), spec, "vec", "kv", base)
    small = torch.zeros(4 * 2 * 8 * 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="multiples of 16"):
        hv._attention_records(3, small.view(4, 2, 8, 64), _attention_spec(block_size=8), "amx",
                              "kv", small.untyped_storage().data_ptr())

def test_mamba_page_of_another_size_than_the_spec_is_refused_naming_it():
    spec = types.SimpleNamespace(shapes=((3, 8), (2, 4, 4)), dtypes=(torch.float32, torch.float32),
                                 mamba_type=types.SimpleNamespace(name="MAMBA2"))
    page = 3 * 8 * 4 + 2 * 4 * 4 * 4
    buf = torch.zeros(4 * page, dtype=torch.int8)
    base = buf.untyped_storage().data_ptr()
    recs = hv._mamba_records(1, buf.view(4, 1, 1, page), spec, 0, False, "kv", base)
    assert [r["role"] for r in recs] == ["conv", "ssm"]
    with pytest.raises(ValueError, match=rf"layer 1 is \[2, 1, 1, {2 * page}\]"):
        hv._mamba_records(1, buf.view(2, 1, 1, 2 * page), spec, 0, False, "kv", base)


def test_transfer_stats_are_in_nixls_units_and_aggregate():
    s = hv.HxferKVConnectorStats()
    s.record(0.002, 2**20)
    s.record(0.004, 3 * 2**20)
    other = hv.HxferKVConnectorStats()
    other.data["num_failed_transfers"] = 1
    r = s.aggregate(other).reduce()
    assert r["Num successful transfers"] == 2
    assert r["Avg xfer time (ms)"] == 3.0
    assert r["Avg MB per transfer"] == 2.0  # MiB, as NixlConnector's stats divide by 2**20
    assert r["Throughput (MB/s)"] == round(4 / 0.006, 3)
    assert r["Num failed transfers"] == 1
    assert not s.is_empty() and s.clone_and_reset().reduce()["Num successful transfers"] == 2
    assert s.is_empty()



def test_prometheus_metrics_count_every_transfer_of_a_stats_object():
    """What vLLM's API server exposes on /metrics: HxferPromMetrics.observe of the stats data a
    step shipped (vLLM calls it for every step's stats, idle or not)."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()
    types_ = {c: functools.partial(c, registry=reg) for c in (Gauge, Counter, Histogram)}
    cfg = types.SimpleNamespace(kv_transfer_config=None)
    prom = hv.HxferConnector.build_prom_metrics(cfg, types_, ["model_name", "engine"],
                                                {0: ["m", "0"], 1: ["m", "1"]})
    s = hv.HxferKVConnectorStats()
    s.record(0.002, 2**20)
    s.record(0.004, 3 * 2**20)
    s.data["connect_duration"].append(0.01)
    s.data["num_failed_transfers"] = 2
    prom.observe(s.data, engine_idx=1)
    prom.observe(hv.HxferKVConnectorStats().data, engine_idx=1)  # an empty one adds nothing

    def value(name):
        return reg.get_sample_value(name, {"model_name": "m", "engine": "1"})

    assert value("vllm:hxfer_xfer_time_seconds_count") == 2
    assert value("vllm:hxfer_xfer_time_seconds_sum") == pytest.approx(0.006)
    assert value("vllm:hxfer_bytes_transferred_sum") == 4 * 2**20
    assert value("vllm:hxfer_connect_time_seconds_count") == 1
    assert value("vllm:hxfer_num_failed_transfers_total") == 2
    assert value("vllm:hxfer_num_kv_expired_reqs_total") == 0
    assert reg.get_sample_value("vllm:hxfer_xfer_time_seconds_count",
                                {"model_name": "m", "engine": "0"}) == 0

# ---------------------------------------------------------------------------------------------
# The state machines of both sides, driven directly (no vLLM instance), with real hxfer peers.

np = pytest.importorskip("numpy")
import hxfer  # noqa: E402
import time  # noqa: E402


def _vllm_config(role="kv_consumer", tp=1):
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_role=role, engine_id=f"engine-{role}"),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp))


def _request(params, n=100):
    return types.SimpleNamespace(kv_transfer_params=params, request_id="r1",
                                 prompt_token_ids=list(range(n)))


@pytest.mark.parametrize("bad", [
    {"hxfer_peers": "ucx:127.0.0.1:1", "hxfer_request_id": 5},
    {"hxfer_peers": [7], "hxfer_request_id": 5},
    {"hxfer_peers": ["ucx:127.0.0.1:1"], "hxfer_request_id": -5},
    {"hxfer_peers": ["ucx:127.0.0.1:1"], "hxfer_request_id": 2**64},
    {"hxfer_peers": ["ucx:127.0.0.1:1"], "hxfer_request_id": "5"},
    {"hxfer_peers": ["ucx:127.0.0.1:1"], "hxfer_request_id": 5, "remote_num_tokens": "99"},
    {"hxfer_peers": ["ucx:127.0.0.1:1"], "hxfer_request_id": 5, "tp_size": 2},
])
def test_hostile_kv_transfer_params_are_computed_locally_not_raised(bad):
    """They come from the client's request body: the scheduler must neither raise nor load."""
    sched = hv._Scheduler(_vllm_config(), None, [], hv._Options.parse({}))
    assert sched.get_num_new_matched_tokens(_request(dict(bad, do_remote_prefill=True)), 0) == (
        0, False)
    good = {"do_remote_prefill": True, "hxfer_peers": ["ucx:127.0.0.1:1"], "hxfer_request_id": 5,
            "remote_num_tokens": 100, "tp_size": 1}
    assert sched.get_num_new_matched_tokens(_request(good), 0) == (100, True)


def test_a_load_without_a_state_block_is_queued_failed_not_dropped():
    """vLLM waits for every load it was told of (load_kv_async): one that cannot start must
    still end, reported failed, or the request and its blocks wait forever."""
    mamba = hv._Group(0, "mamba", types.SimpleNamespace(num_speculative_blocks=0), ("l.0",))
    attn = hv._Group(1, "attention", types.SimpleNamespace(block_size=16), ("l.1",))
    sched = hv._Scheduler(_vllm_config(), None, [mamba, attn], hv._Options.parse({}))
    params = {"do_remote_prefill": True, "hxfer_peers": ["ucx:127.0.0.1:1"],
              "hxfer_request_id": 5, "remote_num_tokens": 99, "tp_size": 1}
    blocks = types.SimpleNamespace(get_block_ids=lambda: ([], list(range(1, 8))),
                                   get_unhashed_block_ids_all_groups=lambda: ([], []))
    sched.update_state_after_alloc(_request(params), blocks, 99)
    r = sched.build_connector_meta(None).reqs_to_recv["r1"]
    assert r.failed and "no state block in KV cache group 0" in r.failed


def _memory(layout):
    pools = {p["name"]: np.zeros(p["bytes"], np.uint8) for p in layout.pools()}
    return hxfer.Memory(layout, pools), pools


def _worker(layout, role="kv_consumer", **extra):
    w = hv._Worker(_vllm_config(role), None, [],
                   hv._Options.parse(dict({"backend": "ucx", "request_timeout": 5,
                                           "handshake_timeout": 5}, **extra)))
    w.layout = layout
    w.memory, w._pools = _memory(layout)
    return w


def _results_until(worker, rid, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = worker.transfer_results()
        if rid in out.finished_recving:
            return out
        time.sleep(0.02)
    raise AssertionError(f"load {rid} never reported (loads in flight: {list(worker._loads)})")


def _load(hxfer_id, address, blocks=(3, 4), slot=2):
    return hv._RecvReq(hxfer_id=hxfer_id, remote_engine_id="P", peers=(address,), peer_tp=1,
                       num_tokens=40, prefix_tokens=0, blocks=list(blocks), slot=slot,
                       group_slots=[], group_blocks={})


@pytest.fixture
def layout():
    return hxfer.Layout.engine("vllm", model="tiny-hybrid", tp=1, num_blocks=64, num_slots=8)


def test_loads_after_the_prefill_instance_went_away_are_reported_failed_not_waited_for(layout):
    """A load hxfer refuses before taking its pages (its context rank is down) is never
    released by hxfer: it must be reported failed at once, not waited for forever."""
    tx_mem, _ = _memory(layout)
    tx = hxfer.Sender(layout, tx_mem, listen="127.0.0.1:0", backend="ucx", instance="p")
    w = _worker(layout)
    try:
        tx.mark_ready(1, blocks=[1, 2], slot=1)
        w._start("a", _load(1, tx.address))
        out = _results_until(w, "a")
        assert "a" not in out.failed_recving
        tx.shutdown()
        time.sleep(1.0)  # the Receiver sees its context rank go
        for i, rid in enumerate(("b", "c")):
            w._start(rid, _load(2 + i, tx.address, blocks=(5 + 2 * i, 6 + 2 * i), slot=3 + i))
            out = _results_until(w, rid)
            assert rid in out.failed_recving
        assert not w._loads
        assert w.stats.data["num_failed_transfers"] == 2
    finally:
        w.shutdown()
        tx.shutdown()


def test_a_kv_both_worker_loads_with_a_memory_of_its_own(layout):
    """kv_both: the Sender holds the worker's first Memory; its Receivers need their own."""
    tx_mem, _ = _memory(layout)
    tx = hxfer.Sender(layout, tx_mem, listen="127.0.0.1:0", backend="ucx", instance="p")
    w = _worker(layout, role="kv_both")
    w.sender = hxfer.Sender(layout, w.memory, listen="127.0.0.1:0", backend="ucx",
                            instance="both")
    try:
        tx.mark_ready(7, blocks=[1, 2], slot=1)
        w._start("a", _load(7, tx.address))
        out = _results_until(w, "a")
        assert "a" not in out.failed_recving, w.stats.data
    finally:
        w.shutdown()
        tx.shutdown()


def _senders(layout, n):
    out = []
    for i in range(n):
        mem, _ = _memory(layout)
        out.append(hxfer.Sender(layout, mem, listen="127.0.0.1:0", backend="ucx",
                                instance=f"p{i}"))
    return out


def test_a_prefill_instance_restarted_at_its_addresses_keeps_its_receiver(layout):
    """P restarted with a new engine id at the same address: D's Receiver for that address
    serves it (a second Receiver of the same instance name would take the first one's
    connection over, and back, forever)."""
    tx, = _senders(layout, 1)
    w = _worker(layout)
    try:
        for i, engine in enumerate(("P", "P-restarted")):
            tx.mark_ready(10 + i, blocks=[1 + 2 * i, 2 + 2 * i], slot=1 + i)
            w._start(f"r{i}", dataclasses.replace(_load(10 + i, tx.address),
                                                  remote_engine_id=engine))
            out = _results_until(w, f"r{i}")
            assert f"r{i}" not in out.failed_recving, w.stats.data
        assert len(w.receivers) == 1
    finally:
        w.shutdown()
        tx.shutdown()


def test_receivers_are_bounded_closing_idle_ones_first(layout, monkeypatch):
    """The addresses come from requests: D keeps at most MAX_RECEIVERS Receivers, closes the
    oldest idle one for a new P, and fails a load at once when every one is busy."""
    monkeypatch.setattr(hv, "MAX_RECEIVERS", 2)
    txs = _senders(layout, 3)
    w = _worker(layout)
    try:
        for i, tx in enumerate(txs):  # each load completes: its Receiver goes idle
            tx.mark_ready(20 + i, blocks=[1 + 2 * i, 2 + 2 * i], slot=1 + i)
            w._start(f"a{i}", _load(20 + i, tx.address, blocks=(1 + 2 * i, 2 + 2 * i), slot=1 + i))
            assert f"a{i}" not in _results_until(w, f"a{i}").failed_recving, w.stats.data
        assert [k[0] for k in w.receivers] == [(txs[1].address,), (txs[2].address,)]
        # Loads in flight on both (never marked ready): a third P's load fails at once.
        w._start("b1", _load(31, txs[1].address, blocks=(9, 10), slot=5))
        w._start("b2", _load(32, txs[2].address, blocks=(11, 12), slot=6))
        w._start("b0", _load(30, txs[0].address, blocks=(13, 14), slot=7))
        out = _results_until(w, "b0", timeout=2.0)
        assert "b0" in out.failed_recving
        assert len(w.receivers) == 2
        for rid in ("b1", "b2"):
            w._cancel(rid)
            _results_until(w, rid)
    finally:
        w.shutdown()
        for tx in txs:
            tx.shutdown()


def test_a_load_vllm_cancels_is_not_a_failed_transfer(layout):
    tx, = _senders(layout, 1)
    w = _worker(layout)
    try:
        w._start("x", _load(40, tx.address))  # P never marks it ready
        time.sleep(0.2)
        w._cancel("x")
        out = _results_until(w, "x")
        assert "x" in out.finished_recving
        assert w.stats.data["num_failed_transfers"] == 0
        assert not w._cancelled
    finally:
        w.shutdown()
        tx.shutdown()


def test_get_finished_refuses_rather_than_hide_a_failed_load():
    c = hv.HxferConnector.__new__(hv.HxferConnector)
    with pytest.raises(NotImplementedError, match="get_transfer_results"):
        c.get_finished(set())
