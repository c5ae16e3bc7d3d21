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
