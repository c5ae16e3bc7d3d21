"""hxfer.vllm's checks that need vLLM importable but no running instance: the configuration it
refuses (naming the key and what it expects), the tensors it refuses to describe, and its
transfer statistics in NixlConnector's units. Seconds, not minutes: run before the pairs."""
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
    ({"ucx_options": "TLS=tcp"}, ["['ucx_options']='TLS=tcp'", "a dict"]),
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
    assert (o.lease_timeout, o.request_timeout, o.handshake_timeout) == (120.0, 30.0, 10.0)
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
