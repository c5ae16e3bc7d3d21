"""Bad input raises hxfer.Error with the status code, and a message naming the thing."""

import pickle

import numpy as np
import pytest
import torch

import hxfer
from pages import numpy_pools, tiny_layout


def raises(code):
    """pytest.raises for hxfer.Error; checks the code once the block ends."""

    class Check:
        def __enter__(self):
            self._ctx = pytest.raises(hxfer.Error)
            self.info = self._ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self._ctx.__exit__(*exc)
            e = self.info.value
            assert e.code == code, f"{e.code} != {code}: {e}"
            assert str(e) == f"{e.code}: {e.message}"
            return handled

    return Check()


@pytest.fixture
def lay():
    return tiny_layout("vllm")


def test_error_carries_code_and_message_and_pickles():
    with raises("InvalidArgument") as e:
        hxfer.Layout.engine("nonesuch")
    err = e.value
    assert isinstance(err, Exception)
    assert "nonesuch" in err.message
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.code, again.message) == (hxfer.Error, err.code, err.message)


def test_unknown_engine_names_the_value_and_the_choices():
    with raises("InvalidArgument") as e:
        hxfer.Layout.engine("tensorrt", model="tiny-hybrid", num_blocks=4, num_slots=2)
    assert "'tensorrt'" in e.value.message and "vllm" in e.value.message


def test_layout_options_out_of_range_are_named():
    with raises("InvalidArgument") as e:
        tiny_layout("hxfer", tp=2, tp_rank=2)
    assert "tp_rank=2" in e.value.message
    with raises("InvalidArgument") as e:
        tiny_layout("hxfer", kv_dtype="int3")
    assert "kv_dtype" in e.value.message
    with raises("NotFound") as e:
        hxfer.Layout.engine("hxfer", model="no-such-dir/config.json", num_blocks=4, num_slots=2)
    assert "no-such-dir/config.json" in e.value.message


def test_short_buffer_names_the_pool_and_both_sizes(lay):
    bufs = numpy_pools(lay)
    pool = lay.pools()[0]
    bufs[pool["name"]] = np.zeros(pool["bytes"] - 1, np.uint8)
    with raises("InvalidArgument") as e:
        hxfer.Memory(lay, bufs)
    msg = e.value.message
    assert f"pool {pool['name']}" in msg
    assert str(pool["bytes"] - 1) in msg and str(pool["bytes"]) in msg


def test_read_only_numpy_array_is_refused_naming_the_pool(lay):
    bufs = numpy_pools(lay)
    name = lay.pools()[1]["name"]
    bufs[name].flags.writeable = False
    with raises("InvalidArgument") as e:
        hxfer.Memory(lay, bufs)
    assert f"pool {name}: buffer is read-only" in e.value.message


def test_bytes_object_is_refused_as_read_only(lay):
    bufs = numpy_pools(lay)
    name = lay.pools()[0]["name"]
    bufs[name] = bytes(lay.pools()[0]["bytes"])
    with raises("InvalidArgument") as e:
        hxfer.Memory(lay, bufs)
    assert f"pool {name}: buffer is read-only" in e.value.message


def test_read_only_memoryview_is_refused(lay):
    bufs = numpy_pools(lay)
    name = lay.pools()[0]["name"]
    bufs[name] = memoryview(bytearray(lay.pools()[0]["bytes"])).toreadonly()
    with raises("InvalidArgument") as e:
        hxfer.Memory(lay, bufs)
    assert f"pool {name}: buffer is read-only" in e.value.message


def test_non_contiguous_array_is_refused(lay):
    bufs = numpy_pools(lay)
    name = lay.pools()[0]["name"]
    bufs[name] = np.zeros(2 * lay.pools()[0]["bytes"], np.uint8)[::2]
    with raises("InvalidArgument") as e:
        hxfer.Memory(lay, bufs)
    assert f"pool {name}: buffer is not contiguous" in e.value.message


def test_missing_pool_is_named(lay):
    bufs = numpy_pools(lay)
    name = lay.pools()[-1]["name"]
    del bufs[name]
    with raises("InvalidArgument") as e:
        hxfer.Memory(lay, bufs)
    assert f"pool {name} has no buffer" in e.value.message


def test_unknown_pool_name_is_named_with_the_layouts_pools(lay):
    bufs = numpy_pools(lay)
    bufs["k.99"] = np.zeros(16, np.uint8)
    with raises("InvalidArgument") as e:
        hxfer.Memory(lay, bufs)
    assert "'k.99'" in e.value.message and lay.pools()[0]["name"] in e.value.message


def test_object_without_a_buffer_is_refused_naming_its_type(lay):
    bufs = numpy_pools(lay)
    name = lay.pools()[0]["name"]
    bufs[name] = [0] * lay.pools()[0]["bytes"]
    with raises("InvalidArgument") as e:
        hxfer.Memory(lay, bufs)
    assert f"pool {name}" in e.value.message and "list" in e.value.message


def test_tensor_off_the_cpu_is_refused_as_unsupported_device_memory(lay):
    bufs = numpy_pools(lay)
    pool = lay.pools()[0]
    bufs[pool["name"]] = torch.zeros(pool["bytes"], dtype=torch.uint8, device="meta")
    with raises("InvalidArgument") as e:
        hxfer.Memory(lay, bufs)
    assert f"pool {pool['name']}" in e.value.message
    assert "hxfer takes host memory and CUDA device memory, not meta" in e.value.message


def test_non_contiguous_tensor_is_refused(lay):
    bufs = numpy_pools(lay)
    pool = lay.pools()[0]
    bufs[pool["name"]] = torch.zeros(2 * pool["bytes"], dtype=torch.uint8)[::2]
    with raises("InvalidArgument") as e:
        hxfer.Memory(lay, bufs)
    assert "not contiguous" in e.value.message


def test_memory_for_another_layout_is_refused(lay):
    other = tiny_layout("hxfer")
    with raises("InvalidArgument") as e:
        hxfer.Sender(other, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc")
    assert "another layout" in e.value.message


@pytest.mark.parametrize("field,value,words", [
    ("stall_timeout", -1.0, "non-negative"), ("lease_timeout", float("nan"), "non-negative"),
    ("stall_timeout", float("nan"), "non-negative"), ("stall_timeout", 0.0, "must be positive")])
def test_a_timeout_out_of_its_range_is_refused_naming_it(lay, field, value, words):
    with raises("InvalidArgument") as e:
        hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc", **{field: value})
    assert e.value.message.startswith(f"{field}=") and words in e.value.message


def test_one_memory_serves_one_sender_or_receiver_at_a_time(lay):
    mem = hxfer.Memory(lay, numpy_pools(lay))
    with hxfer.Sender(lay, mem, backend="inproc"):
        with raises("InvalidArgument") as e:
            hxfer.Sender(lay, mem, backend="inproc")
        assert "already used" in e.value.message
    with hxfer.Sender(lay, mem, backend="inproc"):  # free again once the first shut down
        pass


def test_shm_by_name_with_private_memory_is_refused_naming_the_backend(lay):
    with raises("InvalidArgument") as e:
        hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="shm")
    assert "backend=shm" in e.value.message
    with raises("InvalidArgument") as e:
        hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="carrier-pigeon")
    assert "carrier-pigeon" in e.value.message


def test_receiver_peer_addresses_that_name_no_backend_or_mix_them_are_refused(lay):
    mem = hxfer.Memory(lay, numpy_pools(lay))
    with raises("InvalidArgument") as e:
        hxfer.Receiver(lay, mem, peers=["somewhere"])
    assert "somewhere" in e.value.message
    with raises("InvalidArgument") as e:
        hxfer.Receiver(lay, mem, peers=["shm:a", "ucx:127.0.0.1:1"], peer_tp=2)
    assert "mix" in e.value.message
    with raises("InvalidArgument"):
        hxfer.Receiver(lay, mem, peers=[])


def test_mark_ready_refuses_pages_outside_or_twice_and_lets_requests_share_pages(lay):
    with hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc") as tx:
        with raises("InvalidArgument") as e:
            tx.mark_ready(1, [3, 16], 0)
        assert "block 16 is outside" in e.value.message
        with raises("InvalidArgument") as e:
            tx.mark_ready(1, [3, 3], 0)
        assert "block 3 listed twice" in e.value.message
        with raises("InvalidArgument") as e:
            tx.mark_ready(1, [3, 4])
        assert "no slot given" in e.value.message
        with raises("InvalidArgument") as e:
            tx.mark_ready(1, [3, 4], 1, aux=b"x" * 20000)
        assert "aux is 20000 bytes" in e.value.message
        assert not tx.holds(1)

        tx.mark_ready(1, [3, 4], 0)
        with raises("InvalidArgument") as e:
            tx.mark_ready(1, [7], 2)
        assert "already known" in e.value.message
        # The sender only reads its pages: requests may share them (a cached prefix).
        tx.mark_ready(2, [3, 5], 1)
        assert tx.holds(1) and tx.holds(2) and not tx.holds(3)


def test_block_lists_must_hold_page_indices(lay):
    with hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc") as tx:
        with raises("InvalidArgument") as e:
            tx.mark_ready(1, [3, -1], 0)
        assert "blocks[1]=-1" in e.value.message
        with pytest.raises(TypeError, match=r"blocks\[0\] must be an int"):
            tx.mark_ready(1, [1.5], 0)
        with pytest.raises(TypeError, match="sequence of ints"):
            tx.mark_ready(1, 3, 0)
        with pytest.raises(TypeError, match="aux must be bytes-like"):
            tx.mark_ready(1, [3], 0, aux="text")


def test_negative_timeout_is_refused(lay):
    with hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc") as tx:
        rx_lay = tiny_layout("vllm")
        with hxfer.Receiver(rx_lay, hxfer.Memory(rx_lay, numpy_pools(rx_lay)),
                            peers=[tx.address], backend="inproc") as rx:
            with raises("InvalidArgument") as e:
                rx.wait(1, timeout=-1)
            assert "timeout" in e.value.message
            with raises("NotFound"):
                rx.wait(1, timeout=0.01)


def test_calls_after_shutdown_say_unavailable(lay):
    tx = hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc")
    with tx as entered:
        assert entered is tx
    with raises("Unavailable"):
        tx.mark_ready(1, [1], 1)
    tx.shutdown()  # idempotent
    tx.cancel(1)  # always ok


def test_pools_over_the_same_bytes_are_refused_naming_both(lay):
    """Round 3, finding 10: two pools aliasing each other were accepted."""
    pools = lay.pools()
    whole = np.zeros(pools[0]["bytes"] + pools[1]["bytes"], np.uint8)
    bufs = numpy_pools(lay)
    bufs[pools[0]["name"]] = whole[:pools[0]["bytes"]]
    bufs[pools[1]["name"]] = whole[pools[0]["bytes"] - 8:][:pools[1]["bytes"]]
    with raises("InvalidArgument") as e:
        hxfer.Memory(lay, bufs)
    assert "overlap" in e.value.message
    assert pools[0]["name"] in e.value.message and pools[1]["name"] in e.value.message


def test_a_numpy_pool_resized_under_the_memory_makes_it_refuse_every_page(lay):
    """Round 3, finding 10: numpy's resize(refcheck=False) reallocated a registered pool and hxfer
    went on writing the freed memory. The Memory now notices before any page is handed over."""
    bufs = numpy_pools(lay)
    mem = hxfer.Memory(lay, bufs)
    name = lay.pools()[0]["name"]
    with hxfer.Sender(lay, mem, backend="inproc") as tx:
        tx.mark_ready(1, blocks=[0], slot=0)
        bufs[name].resize(bufs[name].size * 8, refcheck=False)
        for _ in range(2):
            with raises("InvalidArgument") as e:
                tx.mark_ready(2, blocks=[1], slot=1)
            assert f"pool {name}: its memory moved" in e.value.message
    with raises("InvalidArgument"):
        hxfer.Sender(lay, mem, backend="inproc")


def test_a_tensor_given_another_storage_keeps_its_old_one_alive_and_is_refused(lay):
    """Round 3, finding 10: a tensor's set_ freed the storage hxfer wrote into (SIGSEGV in a copy
    worker). The Memory holds the storage it registered, and refuses pages once it moved."""
    bufs = {p["name"]: torch.zeros(p["bytes"], dtype=torch.uint8) for p in lay.pools()}
    mem = hxfer.Memory(lay, bufs)
    name = lay.pools()[0]["name"]
    old = bufs[name].data_ptr()
    with hxfer.Receiver(lay, mem, peers=["inproc:nowhere"], backend="inproc") as rx:
        bufs[name].set_(torch.zeros(bufs[name].numel(), dtype=torch.uint8).storage())
        assert bufs[name].data_ptr() != old
        with raises("InvalidArgument") as e:
            rx.start(1, num_tokens=10, blocks=[0], slot=0)
        assert f"pool {name}: its memory moved" in e.value.message
