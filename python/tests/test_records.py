"""Layout.records(): where every element of a layer's records lies in the engine's pools."""

import hxfer
import pytest

from pages import tiny_layout


@pytest.mark.parametrize("engine", ["hxfer", "trtllm-v1", "trtllm-v2", "vllm", "sglang"])
def test_records_name_pools_sections_and_dims_that_fit_inside_the_pool(engine):
    lay = tiny_layout(engine, tp=2, tp_rank=1)
    pools = {p["name"]: p for p in lay.pools()}
    roles_seen = set()
    for layer in lay.layers():
        for role in ("kv", "conv", "ssm"):
            try:
                parts = lay.records(layer, role)
            except hxfer.Error as e:
                assert e.code == "NotFound", str(e)
                continue
            roles_seen.add(role)
            for part in parts:
                assert part["pool"] in pools
                extent = 0
                for d in part["dims"]:
                    extent = max(extent, (d["size"] - 1) * d["stride"] + part["element_bytes"])
                last = part["offset"] + (part["num_indices"] - 1) * part["index_stride"]
                assert last + extent <= pools[part["pool"]]["bytes"], (layer, role, part)
                assert part["dtype"] in ("fp32", "fp16", "bf16", "fp8")
                for sec in part["sections"]:
                    assert sec["units"] >= 1 and sec["unit_len"] >= 1, sec
            names = [s["name"] for p in parts for s in p["sections"]]
            if role == "kv":
                assert names == ["K", "V"], names
            if role == "conv":
                assert names == ["x", "B", "C"], names
    assert roles_seen == {"kv", "conv", "ssm"}


def test_records_of_a_layer_or_role_the_rank_lacks_raise_clear_errors():
    lay = tiny_layout("sglang")
    with pytest.raises(hxfer.Error) as e:
        lay.records(0, "weights")
    assert e.value.code == "InvalidArgument" and "weights" in str(e.value)
    with pytest.raises(hxfer.Error) as e:
        lay.records(999, "kv")
    assert e.value.code == "NotFound" and "999" in str(e.value)


def vllm_like_views(lay):
    """Tensors the way vLLM 0.32 hands them to its connector: one int8 buffer per shared
    tensor, each attention layer a bf16 view [blocks, heads, tokens, 2 x head_dim] of it (K and
    V side by side; LBNHC: token outermost inside the page, or LBHNC), each Mamba layer a raw
    [blocks, 1, 1, page bytes] int8 view. Built with torch.as_strided from strides computed
    here, not read from hxfer's layout."""
    torch = pytest.importorskip("torch")
    H, T, D = 4, lay.tokens_per_block, 8  # tiny-hybrid: 4 kv heads of 8
    conv_bytes, ssm_bytes = 3 * 64 * 2, 8 * 4 * 8 * 4  # (k-1, channels) bf16; (heads, hd, st) fp32
    page = H * T * 2 * D * 2
    buffers = {p["name"]: torch.zeros(p["bytes"], dtype=torch.int8) for p in lay.pools()}
    return torch, H, T, D, conv_bytes, ssm_bytes, page, buffers


@pytest.mark.parametrize("kv_order", ["nhd", "hnd"])
def test_a_layout_from_vllm_like_tensors_is_vllms_named_layout(kv_order):
    """Layout.from_records over the records hxfer.tensors reads off vLLM-shaped tensors gives
    the named layout's records, element by element (every dim's size and stride)."""
    from hxfer.tensors import contiguous_record, tensor_record
    named = hxfer.Layout.engine("vllm", model="tiny-hybrid", num_blocks=16, num_slots=16,
                                kv_layout=kv_order, shared_tensors="on")
    torch, H, T, D, conv_bytes, ssm_bytes, page, buffers = vllm_like_views(named)
    records = []
    for layer in named.layers():
        for role in ("kv", "conv", "ssm"):
            try:
                part = named.records(layer, role)[0]
            except hxfer.Error:
                continue
            buf = buffers[part["pool"]]
            base = buf.data_ptr()
            if role == "kv":
                # [B, H, N, C] with C = 2 x head_dim bf16; LBNHC keeps the token outside the head.
                strides = (page // 2, 2 * D, H * 2 * D, 1) if kv_order == "nhd" else \
                          (page // 2, T * 2 * D, 2 * D, 1)
                view = torch.as_strided(buf.view(torch.bfloat16), (16, H, T, 2 * D), strides,
                                        part["offset"] // 2)
                records.append(tensor_record(layer, "kv", view, part["pool"], base,
                                             ["head", "token", [("kv", 2), ("dim", D)]]))
            elif role == "conv":
                raw = torch.as_strided(buf, (16, 1, 1, conv_bytes + ssm_bytes), (page, 1, 1, 1),
                                       part["offset"])
                offset = raw.data_ptr() - base
                g = part["state_group"]
                records.append(contiguous_record(layer, "conv", part["pool"], offset, page,
                                                 (3, 64), ["window", "channel"], 2, state_group=g))
                records.append(contiguous_record(layer, "ssm", part["pool"], offset + conv_bytes,
                                                 page, (8, 4, 8), ["head", "head_dim", "state"], 4,
                                                 state_group=g))
    described = hxfer.Layout.from_records(
        model="tiny-hybrid", num_blocks=16, num_slots=16, pools={p["name"]: p["bytes"]
                                                                for p in named.pools()},
        records=records, state_groups=named.state_groups, joint_ids=named.joint_ids,
        label="vllm-tensors")
    for layer in named.layers():
        for role in ("kv", "conv", "ssm"):
            try:
                want = named.records(layer, role)
            except hxfer.Error:
                continue
            got = described.records(layer, role)
            for w, g in zip(want, got):
                for key in ("pool", "offset", "index_stride", "state_group", "sections"):
                    assert g[key] == w[key], (layer, role, key, g[key], w[key])
                # The same dims (the view lists head before token; memory order is by stride).
                by_stride = lambda dims: sorted(dims, key=lambda d: -d["stride"])  # noqa: E731
                assert by_stride(g["dims"]) == by_stride(w["dims"]), (layer, role)
    assert "vllm-tensors tiny-hybrid" in described.describe()
    # It travels: pickled with its description, equal when unpickled.
    import pickle
    assert pickle.loads(pickle.dumps(described)) == described
    assert described.description["joint_ids"] is True


def test_from_records_names_what_is_wrong():
    from hxfer.tensors import contiguous_record
    with pytest.raises(hxfer.Error) as e:
        hxfer.Layout.from_records(model="tiny-hybrid", num_blocks=4, num_slots=4,
                                  pools={"p": 1 << 20}, records=[])
    assert e.value.code == "InvalidArgument" and "is not described" in e.value.message
    with pytest.raises(ValueError, match="do not multiply"):
        from hxfer.tensors import tensor_record
        import numpy as np
        a = np.zeros((4, 6), np.uint16)
        tensor_record(0, "kv", a, "p", a.__array_interface__["data"][0], [[("kv", 2), ("dim", 4)]])
    rec = contiguous_record(1, "conv", "nowhere", 0, 1024, (3, 64), ["window", "channel"], 2)
    assert rec["dims"] == [("window", 3, 128), ("channel", 64, 2)]
