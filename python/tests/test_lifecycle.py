"""Page lifetimes, cancellation, callbacks and the GIL, as Python sees them."""

import gc
import sys
import threading
import time

import pytest

import hxfer
from pages import Released, numpy_pools, tiny_layout, wait_until


class Pair:
    """One context rank and one generation rank in this process (inproc)."""

    def __init__(self, ctx_engine="sglang", gen_engine="hxfer", **sender_options):
        self.ctx, self.gen = tiny_layout(ctx_engine), tiny_layout(gen_engine)
        self.ctx_released, self.gen_released = Released(), Released()
        self.tx = hxfer.Sender(self.ctx, hxfer.Memory(self.ctx, numpy_pools(self.ctx)),
                               backend="inproc", on_released=self.ctx_released, **sender_options)
        self.rx = hxfer.Receiver(self.gen, hxfer.Memory(self.gen, numpy_pools(self.gen)),
                                 peers=[self.tx.address], backend="inproc",
                                 on_released=self.gen_released)
        self.rx.wait_for_peers(timeout=10.0)

    def close(self):
        self.rx.shutdown()
        self.tx.shutdown()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_receiver_cancel_fails_the_request_with_cancelled_and_releases_its_pages(pair):
    pair.rx.start(1, 40, [4, 5], 0)  # the context rank never marks it ready
    pair.rx.cancel(1)
    res = pair.rx.poll(1)
    assert (res.state, res.code, res.ok) == ("failed", "Cancelled", False)
    assert "Cancelled" in res.error
    assert pair.gen_released.wait_for(1)
    assert not pair.rx.holds(1)
    pair.rx.cancel(1)  # a no-op once terminal
    pair.rx.release(1)  # forgets the result
    with pytest.raises(hxfer.Error) as e:
        pair.rx.cancel(1)
    assert e.value.code == "NotFound"
    assert pair.rx.metrics()["requests_held"] == 0


def test_sender_cancel_before_mark_ready_turns_it_away_and_leaves_the_pages_free(pair):
    pair.tx.cancel(5)
    with pytest.raises(hxfer.Error) as e:
        pair.tx.mark_ready(5, [1, 2], 1)
    assert e.value.code == "Cancelled"
    assert wait_until(lambda: not pair.tx.holds(5))
    pair.tx.mark_ready(6, [1, 2], 1)  # the same pages, another request
    assert pair.tx.holds(6)


def test_sender_cancel_after_mark_ready_releases_the_pages_once(pair):
    pair.tx.mark_ready(2, [1, 2], 1)
    assert pair.tx.holds(2)
    pair.tx.cancel(2)
    pair.tx.cancel(2)  # idempotent
    assert pair.ctx_released.wait_for(2)
    assert not pair.tx.holds(2)
    assert pair.ctx_released.count(2) == 1
    # A generation rank asking afterwards hears it was cancelled.
    pair.rx.start(2, 64, [7, 8], 3)
    res = pair.rx.wait(2, timeout=10.0)
    assert res.state == "failed" and res.code == "Cancelled", res


def test_released_pages_are_reused_and_fenced_pages_are_refused(pair):
    pair.tx.mark_ready(1, [1, 2], 1)

    pair.rx.start(1, 64, [4, 5], 0)
    with pytest.raises(hxfer.Error) as e:  # generation pages fenced while in flight or done
        pair.rx.start(2, 64, [5, 6], 1)
    assert e.value.code == "InvalidArgument" and "block 5" in e.value.message
    assert pair.rx.wait(1, timeout=30.0).ok
    with pytest.raises(hxfer.Error):
        pair.rx.start(2, 64, [5, 6], 1)
    assert pair.rx.holds(1) and pair.gen_released.count(1) == 0

    pair.rx.release(1)
    assert pair.gen_released.wait_for(1) and not pair.rx.holds(1)
    assert pair.ctx_released.wait_for(1) and not pair.tx.holds(1)
    # Both sides' pages serve a new request now.
    pair.tx.mark_ready(2, [2, 1], 1)
    pair.rx.start(2, 64, [5, 4], 0)
    assert pair.rx.wait(2, timeout=30.0).ok
    pair.rx.release(2)


def test_unasked_pages_are_released_when_the_lease_expires():
    p = Pair(lease_timeout=0.2)
    try:
        p.tx.mark_ready(3, [1], 2)
        assert p.ctx_released.wait_for(3)
        assert not p.tx.holds(3)
        assert p.tx.metrics()["leases_expired"] == 1
    finally:
        p.close()


def test_wait_releases_the_gil_so_python_threads_keep_running(pair):
    pair.rx.start(9, 32, [1], 0)  # never marked ready: wait() times out
    ticks = 0
    stop = threading.Event()

    def tick():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    t = threading.Thread(target=tick)
    t.start()
    try:
        time.sleep(0.05)
        before = ticks
        began = time.monotonic()
        res = pair.rx.wait(9, timeout=0.5)
        waited = time.monotonic() - began
        during = ticks - before
    finally:
        stop.set()
        t.join()
    assert res.state == "in_progress" and not res.terminal
    assert waited >= 0.45
    assert during > 20, f"the ticker ran {during} times in {waited:.2f} s of wait()"
    pair.rx.cancel(9)


def test_on_request_runs_on_an_hxfer_thread_and_may_mark_the_request_ready():
    seen = []

    def on_request(request_id, num_tokens, aux):
        seen.append((request_id, num_tokens, aux, threading.current_thread() is main))
        p.tx.mark_ready(request_id, [int(aux)], 2)

    main = threading.current_thread()
    p = Pair(on_request=on_request)
    try:
        p.rx.start(4, 30, [3], 1, aux=b"6")
        res = p.rx.wait(4, timeout=30.0)
        assert res.ok, res.error
        assert seen == [(4, 30, b"6", False)]
        p.rx.release(4)
        assert p.ctx_released.wait_for(4)
    finally:
        p.close()


def test_exception_in_a_callback_is_reported_not_propagated(monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_value))
    calls = []

    def on_released(request_id):
        calls.append(request_id)
        raise RuntimeError(f"engine bug on {request_id}")

    lay = tiny_layout("hxfer")
    with hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc",
                      on_released=on_released) as tx:
        tx.mark_ready(1, [1], 1)
        tx.cancel(1)
        assert wait_until(lambda: calls == [1] and reported)
        tx.mark_ready(2, [1], 1)  # hxfer carries on
        tx.cancel(2)
        assert wait_until(lambda: calls == [1, 2])
    assert isinstance(reported[0], RuntimeError) and "engine bug on 1" in str(reported[0])


def test_callbacks_calling_back_in_and_shutdown_from_python_do_not_deadlock():
    lay = tiny_layout("trtllm-v2")
    holds = []

    def on_released(request_id):
        holds.append(tx.holds(request_id))  # back into hxfer, from its thread
        time.sleep(0.01)  # keep the callback running while shutdown() joins

    tx = hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc",
                      on_released=on_released)
    for i in range(5):
        tx.mark_ready(i, [i], i)
    tx.shutdown()  # releases all five: each callback needs the GIL this thread gave up
    assert sorted(holds) == [False] * 5


def test_dropping_live_objects_shuts_them_down_without_deadlock():
    released = Released()
    lay = tiny_layout("trtllm-v2")
    tx = hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc",
                      on_released=released)
    rx = hxfer.Receiver(lay, hxfer.Memory(lay, numpy_pools(lay)), peers=[tx.address],
                        backend="inproc", on_released=released)
    tx.mark_ready(1, [1], 1)
    rx.start(2, 32, [2], 2)  # in flight, never answered
    del tx, rx
    gc.collect()
    assert released.ids.count(1) == 1 and released.ids.count(2) == 1


def test_shutdown_called_from_inside_a_callback_begins_it_and_returns():
    lay = tiny_layout("trtllm-v2")
    returned = []

    def on_released(request_id):
        if request_id == 1:
            tx.shutdown()  # cannot wait for the very thread it runs on
        returned.append(request_id)

    tx = hxfer.Sender(lay, hxfer.Memory(lay, numpy_pools(lay)), backend="inproc",
                      on_released=on_released)
    tx.mark_ready(1, [1], 1)
    tx.mark_ready(2, [2], 2)
    tx.cancel(1)
    # The shutdown it began releases request 2 too. (Only holds() is called meanwhile: the C++
    # Sender's other methods race with a shutdown running on another thread.)
    assert wait_until(lambda: not tx.holds(2))
    tx.shutdown()  # waits for the one in progress
    assert sorted(returned) == [1, 2]
    with pytest.raises(hxfer.Error) as e:
        tx.mark_ready(3, [3], 3)
    assert e.value.code == "Unavailable"


def test_last_reference_dropped_inside_a_callback_frees_everything_off_that_thread():
    lay = tiny_layout("trtllm-v2")
    bufs = numpy_pools(lay)
    probe = bufs[lay.pools()[0]["name"]]
    refs_before = sys.getrefcount(probe)
    holder = {}
    fired = threading.Event()

    def on_released(request_id):
        holder.clear()  # the Sender's last reference goes, on hxfer's thread
        fired.set()

    holder["tx"] = hxfer.Sender(lay, hxfer.Memory(lay, bufs), backend="inproc",
                                lease_timeout=0.1, on_released=on_released)
    holder["tx"].mark_ready(1, [1], 1)  # released when its lease expires
    assert fired.wait(10.0)
    # Sender, Memory and buffer views all gone: the array is referenced as before.
    assert wait_until(lambda: sys.getrefcount(probe) == refs_before)


def test_memory_keeps_the_buffers_it_registered_when_the_callers_dict_changes():
    lay = tiny_layout("trtllm-v2")
    bufs = numpy_pools(lay)
    mem = hxfer.Memory(lay, bufs)
    name = lay.pools()[0]["name"]
    registered = bufs[name]
    del bufs[name]
    assert mem.buffers[name] is registered
    assert mem.layout == lay and mem.layout is mem.layout


def test_a_long_wait_gives_way_to_ctrl_c(pair):
    """wait() and wait_for_peers() sleep without the GIL, in slices: the program's signal
    handlers run while they wait (KeyboardInterrupt within a slice, not at the timeout)."""
    import _thread

    pair.rx.start(2, 40, [4, 5], 0)  # never marked ready: the wait would last its 60 s
    for wait in (lambda: pair.rx.wait(2, timeout=60.0),
                 lambda: hxfer.Receiver(pair.gen, hxfer.Memory(pair.gen, numpy_pools(pair.gen)),
                                        peers=["inproc:nobody"], backend="inproc")
                 .wait_for_peers(timeout=60.0)):
        timer = threading.Timer(0.3, _thread.interrupt_main)
        t0 = time.monotonic()
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                wait()
        finally:
            timer.cancel()
        assert time.monotonic() - t0 < 10.0
    assert not pair.rx.poll(2).terminal
    pair.rx.cancel(2)
