"""The context rank in another process: ucx over tcp with numpy pools, shm with SharedBuffer
pools on both sides; and examples/python/engine_pair.py, two engines end to end."""

import json
import os
import pathlib
import queue
import subprocess
import sys
import threading

import numpy as np
import pytest

import hxfer
from pages import expect_arrived, gather, pattern, request_span_bytes, scatter, tiny_layout

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def child_env():
    """The environment of a child Python: this one, with the directories that hold the hxfer
    package and the test helpers first on its path."""
    path = [str(pathlib.Path(hxfer.__file__).resolve().parents[1]), str(HERE)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    return env


class ContextRank:
    """context_rank.py in a child process, spoken to in JSON lines."""

    def __init__(self, *args):
        self.proc = subprocess.Popen([sys.executable, str(HERE / "context_rank.py"), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=child_env())
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.hello = self.recv()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def recv(self, timeout=30.0):
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"context rank silent for {timeout} s") from None
        assert line is not None, f"context rank exited with {self.proc.wait()}"
        return json.loads(line)

    def call(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = self.recv()
        assert "error" not in reply, reply["error"]
        return reply

    def quit(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                return self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        return self.proc.wait()


@pytest.mark.parametrize("backend,engine,pools", [
    ("ucx", "vllm", "numpy"),
    ("shm", "trtllm-v2", "shared"),
])
def test_sender_in_another_process_moves_requests_byte_for_byte(backend, engine, pools):
    seed = 77
    ctx = ContextRank("--engine", engine, "--backend", backend, "--pools", pools, "--seed",
                      str(seed))
    try:
        assert ctx.hello["backend"] == backend, ctx.hello["routing"]
        assert ctx.hello["address"].startswith(backend + ":")
        lay = tiny_layout(engine)
        if pools == "shared":
            bufs = {p["name"]: hxfer.SharedBuffer(p["bytes"], p["name"]) for p in lay.pools()}
        else:
            bufs = {p["name"]: np.zeros(p["bytes"], np.uint8) for p in lay.pools()}
        ucx = {"TLS": "tcp"} if backend == "ucx" else None
        with hxfer.Receiver(lay, hxfer.Memory(lay, bufs), peers=[ctx.hello["address"]],
                            backend=backend, ucx_options=ucx) as rx:
            assert rx.backend == backend
            rx.wait_for_peers(timeout=20.0)
            requests = [(1, [2, 3], 1, [9, 8], 4), (2, [3], 0, [2], 5), (3, [4, 5], 2, [0, 1], 0)]
            for rid, ctx_blocks, ctx_slot, gen_blocks, gen_slot in requests:
                sent = pattern(request_span_bytes(lay, ctx_blocks, ctx_slot), seed, rid, 0)
                scatter(lay, bufs, gen_blocks, gen_slot, ~sent)
                assert ctx.call(op="ready", id=rid, blocks=ctx_blocks, slot=ctx_slot,
                                aux=f"tok{rid}")["bytes"] == len(sent)
                rx.start(rid, 32 * len(ctx_blocks), gen_blocks, gen_slot)
                res = rx.wait(rid, timeout=30.0)
                assert res.ok, res.error
                assert res.aux == f"tok{rid}".encode()
                # Same layout and tp: each record arrives whole (vllm's page padding excepted).
                expect_arrived(gather(lay, bufs, gen_blocks, gen_slot), sent, res.bytes,
                               f"request {rid}")
                rx.release(rid)
                assert not rx.holds(rid)
            assert rx.metrics()["requests_ok"] == len(requests)
            for rid, *_ in requests:
                acct = ctx.call(op="released", id=rid)
                assert acct["released"] and not acct["holds"], acct
            assert acct["metrics"]["requests_held"] == 0
            assert acct["metrics"]["requests_ok"] == len(requests)
        assert ctx.quit() == 0
    finally:
        ctx.quit()


def test_engine_pair_example_plays_two_engines_end_to_end():
    script = ROOT / "examples" / "python" / "engine_pair.py"
    out = subprocess.run([sys.executable, str(script), "--requests", "30", "--seed", "3"],
                         env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.startswith("engine_pair: 30 requests, ") and summary.endswith(
        "pages accounted"), summary


def test_engine_pair_example_fails_loudly_when_a_returned_byte_is_wrong():
    script = ROOT / "examples" / "python" / "engine_pair.py"
    out = subprocess.run([sys.executable, str(script), "--requests", "6", "--cancel", "0",
                          "--corrupt", "4"],
                         env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "engine_pair: FAILED: " in out.stderr and "request 4" in out.stderr, out.stderr
    assert "pages accounted" not in out.stdout
