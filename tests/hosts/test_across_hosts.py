"""hxfer across hosts, the hosts being network namespaces (scripts/hosts.sh) on this machine.

Host 1 runs context ranks, host 2 generation ranks (`hxfer serve`), each with its own address
on a bridge. shm cannot cross hosts (its Unix sockets are per namespace), so `auto` routing
must pick ucx and say why. Every scenario ends with the pools accounted on every surviving
rank: a generation rank prints "leaked pages 0" after checking every byte against the oracle,
a context rank prints its metrics with "leaked_pages": 0 when stopped.

Needs root and iproute2; ctest runs it as `hosts_tests` (label netns) and reports it skipped
where namespaces cannot be made (scripts/hosts.sh probe).
"""

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOSTS = str(ROOT / "scripts" / "hosts.sh")
SLOWLINK = str(ROOT / "scripts" / "slowlink.py")
HXFER = os.environ.get("HXFER_BIN", str(ROOT / "build" / "hxfer"))
# Built with the CUDA kernels only (nvcc found); it runs over its FakeDevice without a GPU.
GPU_CHECK = os.environ.get("HXFER_GPU_CHECK_BIN",
                           str(ROOT / "build" / "src" / "device" / "hxfer-gpu-check"))
TOKEN = "across-hosts"
POOL = ["--blocks", "256", "--slots", "16"]


def hosts(*args, check=True):
    return subprocess.run([HOSTS, *map(str, args)], check=check, capture_output=True, text=True)


@pytest.fixture(scope="module", autouse=True)
def namespaces():
    if hosts("probe", check=False).returncode != 0:
        pytest.skip("network namespaces cannot be made here (scripts/hosts.sh probe)")
    hosts("up", 3)
    yield
    hosts("down")


def addr(i):
    return hosts("addr", i).stdout.strip()


class Rank:
    """One `hxfer serve` process on host `host`."""

    def __init__(self, host, *args):
        self.log = []
        self.p = subprocess.Popen([HOSTS, "exec", str(host), HXFER, "serve", "--token", TOKEN,
                                   *POOL, *map(str, args)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)

    def line(self, pattern, timeout=20.0):
        """The first output line matching `pattern` (read as it comes)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no line matching {pattern!r}; output:\n{''.join(self.log)}")

    def finish(self, timeout=120.0):
        # Not communicate(): it would skip what readline() already buffered.
        timer = threading.Timer(timeout, self.p.kill)
        timer.start()
        try:
            self.log.append(self.p.stdout.read())
            self.p.wait()
        finally:
            timer.cancel()
        return self.p.returncode, "".join(self.log)

    def stop(self):
        """SIGTERM; a context rank then prints its metrics: returns them."""
        self.p.send_signal(signal.SIGTERM)
        rc, out = self.finish(timeout=30.0)
        metrics = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
        assert metrics, out
        return rc, metrics[-1]

    def kill(self):
        self.p.kill()
        self.p.wait()


def context(host, tp=1, rank=0, *args):
    r = Rank(host, "--role", "context", "--tp", tp, "--rank", rank, "--listen",
             f"{addr(host)}:0", *args)
    routing = r.line(r"^routing: (.*)").group(1)
    r.address = r.line(r"listening on (\S+)").group(1)
    r.routing = routing
    return r


def generation(host, peers, peer_tp, *args, tp=1, rank=0):
    return Rank(host, "--role", "generation", "--tp", tp, "--rank", rank, "--peers",
                ",".join(peers), "--peer-tp", peer_tp, *args)


def summary(out):
    m = re.search(r"(\d+) of (\d+) requests verified, (\d+) bytes, p50 ([\d.]+) us, "
                  r"leaked pages (\d+)", out)
    assert m, out
    return {"ok": int(m[1]), "asked": int(m[2]), "bytes": int(m[3]), "p50_us": float(m[4]),
            "leaked": int(m[5])}


def stop_clean(ctx_ranks):
    for c in ctx_ranks:
        rc, m = c.stop()
        assert m["leaked_pages"] == 0, m
        assert rc == 0, m


@pytest.mark.parametrize("ctx_tp,gen_tp", [(2, 1), (1, 2)])
def test_demo_workload_across_hosts_moves_every_byte_over_ucx(ctx_tp, gen_tp):
    ctx = [context(1, ctx_tp, r, "--instance", "ctx") for r in range(ctx_tp)]
    for c in ctx:
        assert c.routing.startswith("backend ucx"), c.routing
        assert "another host" in c.routing, c.routing
        assert c.address.startswith(f"ucx:{addr(1)}:"), c.address
    gens = [generation(2, [c.address for c in ctx], ctx_tp, "--requests", 8, "--instance", "gen",
                       tp=gen_tp, rank=r)
            for r in range(gen_tp)]
    for g in gens:
        assert "another host" in g.line(r"^routing: (.*)").group(1)
        rc, out = g.finish()
        s = summary(out)
        assert rc == 0 and s["ok"] == s["asked"] == 8 and s["leaked"] == 0, out
    stop_clean(ctx)


def test_an_shm_address_of_another_host_is_refused_naming_it():
    ctx = Rank(1, "--role", "context", "--backend", "shm")
    address = ctx.line(r"listening on (\S+)").group(1)
    assert address.startswith("shm:")
    g = generation(2, [address], 1, "--requests", 1, "--timeout", 5)
    rc, out = g.finish()
    assert rc != 0, out
    assert address.split(":", 1)[1].lstrip("@") in out and "not connected" in out, out
    stop_clean([ctx])


def test_advertise_refuses_loopback_for_other_hosts_and_is_what_peers_use():
    bad = Rank(1, "--role", "context", "--listen", f"{addr(1)}:0", "--advertise", "127.0.0.1")
    rc, out = bad.finish()
    assert rc != 0 and "loopback" in out and "--advertise 127.0.0.1" in out, out
    wildcard = Rank(1, "--role", "context", "--listen", "0.0.0.0:0")
    rc, out = wildcard.finish()
    assert rc != 0 and "--advertise" in out, out
    # Listening on every interface, advertising host 1's address: peers on host 2 use it.
    c = Rank(1, "--role", "context", "--listen", "0.0.0.0:0", "--advertise", addr(1))
    address = c.line(r"listening on (\S+)").group(1)
    assert address.startswith(f"ucx:{addr(1)}:"), address
    rc, out = generation(2, [address], 1, "--requests", 3).finish()
    assert rc == 0 and summary(out)["ok"] == 3, out
    stop_clean([c])


def test_device_pools_across_hosts_go_staged_through_host_memory():
    """A context rank and a generation rank whose pools are (fake) device memory, on two hosts:
    each part is copied on the device into pinned host memory, written over ucx into the
    generation rank's staging region and copied into its pools there (docs/engine.md): two
    requests staged whole, two (a generation rank started again with a 4 KiB region) window by
    window. The pair packs (vllm conv sd to sglang ds); every request is checked by the
    oracle."""
    if not os.access(GPU_CHECK, os.X_OK):
        pytest.skip(f"{GPU_CHECK} is not built (no CUDA toolkit)")
    ctx = subprocess.Popen([HOSTS, "exec", "1", GPU_CHECK, "--fake-across", "ctx",
                            f"{addr(1)}:0", "4"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        first = ctx.stdout.readline()
        m = re.search(r"context listening on (\S+)", first)
        assert m, first + ctx.stdout.read()
        assert m[1].startswith(f"ucx:{addr(1)}:"), first
        gen = subprocess.run([HOSTS, "exec", "2", GPU_CHECK, "--fake-across", "gen", m[1], "4"],
                             capture_output=True, text=True, timeout=120)
        assert gen.returncode == 0, gen.stdout + gen.stderr
        assert "generation: 4 of 4 exact" in gen.stdout, gen.stdout
        assert "2 staged whole, 2 in 1 KiB windows" in gen.stdout, gen.stdout
        rest, _ = ctx.communicate(timeout=120)
        assert ctx.returncode == 0, first + rest
        assert "context: 4 of 4 answered" in rest, first + rest
    finally:
        if ctx.poll() is None:
            ctx.kill()
            ctx.wait()


@contextlib.contextmanager
def slow_link(host, delay_ms, loss):
    """`delay_ms` and `loss` on the host's link: tc netem where the kernel has it, else the
    user-space forwarder (scripts/slowlink.py, the delay then applies each way)."""
    netem = hosts("netem", host, "delay", f"{delay_ms}ms", "loss", f"{loss * 100:g}%",
                  check=False)
    if netem.returncode == 0:
        try:
            yield "netem"
        finally:
            hosts("netem", host, "off")
        return
    p = subprocess.Popen([sys.executable, SLOWLINK, "--host", str(host), "--delay-ms",
                          str(delay_ms), "--loss", str(loss)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        yield "slowlink.py (this kernel has no netem)"
    finally:
        p.terminate()
        print(p.communicate(timeout=30)[0].strip())


def test_slow_lossy_link_completes_every_request():
    with slow_link(1, 50, 0.01) as how:
        c = context(1)
        t = time.monotonic()
        rc, out = generation(2, [c.address], 1, "--requests", 5, "--timeout", 60).finish()
        elapsed = time.monotonic() - t
        s = summary(out)
        print(f"50 ms, 1 % loss ({how}): {s['ok']}/{s['asked']} verified, "
              f"p50 {s['p50_us'] / 1e3:.1f} ms, {elapsed:.1f} s in all")
        assert rc == 0 and s["ok"] == 5 and s["leaked"] == 0, out
        # Data crosses the delayed link: no request can be faster than 50 ms.
        assert s["p50_us"] >= 50e3, s
        stop_clean([c])


def test_rate_limited_link_completes_every_request_at_the_link_rate():
    hosts("rate", 1, "200mbit")  # 25 MB/s into host 1 ... and the acks; data leaves it freely
    hosts("rate", 2, "200mbit")  # into host 2: the transfer's direction
    try:
        c = context(1)
        t = time.monotonic()
        rc, out = generation(2, [c.address], 1, "--requests", 5, "--tokens", 8000,
                             "--timeout", 60).finish()
        elapsed = time.monotonic() - t
        s = summary(out)
        rate = s["bytes"] / elapsed / 1e6
        print(f"tbf 200mbit: {s['ok']}/{s['asked']} verified, {s['bytes']} bytes in "
              f"{elapsed:.2f} s ({rate:.1f} MB/s, link 25 MB/s), p50 {s['p50_us'] / 1e3:.1f} ms")
        assert rc == 0 and s["ok"] == 5 and s["leaked"] == 0, out
        assert rate < 25 * 1.2, f"{rate:.1f} MB/s over a 25 MB/s link: the limit did not apply"
        stop_clean([c])
    finally:
        hosts("rate", 1, "off")
        hosts("rate", 2, "off")


def test_generation_rank_killed_mid_run_frees_its_pages_and_a_restart_serves():
    c = context(1)
    g = generation(2, [c.address], 1, "--requests", 100000, "--tokens", 4000)
    time.sleep(1.5)  # in the middle of its requests
    g.kill()
    rc, out = generation(2, [c.address], 1, "--requests", 5).finish()
    assert rc == 0 and summary(out)["ok"] == 5, out
    rc, m = c.stop()
    assert m["leaked_pages"] == 0, m  # the killed rank's in-flight request was freed
    assert m["requests_ok"] >= 5, m
    # It ran one request at a time: at most that one failed, lost with its peer.
    assert m["requests_failed"] <= 1 and m["failures"]["peer_lost"] == m["requests_failed"], m


def test_link_cut_mid_transfer_then_restored_loses_no_page():
    c = context(1)
    g = generation(2, [c.address], 1, "--requests", 40, "--tokens", 4000, "--timeout", 5)
    time.sleep(1.0)
    hosts("link", 1, "down")
    time.sleep(3.0)
    hosts("link", 1, "up")
    rc, out = g.finish()
    s = summary(out)
    print(f"link cut 3 s: {s['ok']}/{s['asked']} verified; rc {rc}")
    assert s["leaked"] == 0, out
    # Whatever failed while the link was down said why.
    failed = [l for l in out.splitlines() if re.match(r"request \d+: ", l)]
    assert len(failed) == s["asked"] - s["ok"], out
    # After the link is back, a new generation rank is served in full.
    rc, out = generation(2, [c.address], 1, "--requests", 5, "--timeout", 30).finish()
    assert rc == 0 and summary(out)["ok"] == 5, out
    rc, m = c.stop()
    assert m["leaked_pages"] == 0, m


# ---- Discovery through etcd (etcd on host 3) ----

ETCD = "/usr/bin/etcd"


class EtcdOnHost3:
    def __init__(self, data_dir):
        self.data_dir = str(data_dir)
        self.url = f"etcd://{addr(3)}:2379"
        self.p = None

    def start(self):
        client = f"http://{addr(3)}:2379"
        self.p = subprocess.Popen(
            [HOSTS, "exec", "3", ETCD, "--data-dir", self.data_dir, "--listen-client-urls",
             client, "--advertise-client-urls", client, "--listen-peer-urls",
             "http://127.0.0.1:2380", "--logger", "zap", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                req = urllib.request.Request(f"http://{addr(3)}:2379/v3/kv/range",
                                             data=b'{"key":"eA=="}', method="POST")
                urllib.request.urlopen(req, timeout=1).read()
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError("etcd on host 3 did not answer")

    def stop(self):
        if self.p is not None:
            self.p.kill()
            self.p.wait()
            self.p = None


@pytest.fixture
def etcd(tmp_path):
    assert os.access(ETCD, os.X_OK), \
        "/usr/bin/etcd missing: install etcd-server (scripts/install-deps.sh does)"
    e = EtcdOnHost3(tmp_path / "etcd")
    e.start()
    yield e
    e.stop()


def discovering_generation(etcd, instance, requests=3000):
    """A generation rank on host 2 running `requests` requests against `instance`, once it
    found it."""
    g = generation(2, [], 1, "--registry", etcd.url, "--ctx-instance", instance, "--requests",
                   requests, "--timeout", 20)
    g.line(rf"found hxfer/{instance}/context/0")
    return g


def registered_context(host, etcd, instance, tp=1, rank=0):
    r = context(host, tp, rank, "--registry", etcd.url, "--instance", instance)
    m = r.line(r"registered (hxfer/\S+) \(incarnation (\w+)\)")
    assert m[1] == f"hxfer/{instance}/context/{rank}", m[0]
    r.incarnation = m[2]
    return r


def test_generation_finds_the_context_instance_through_etcd(etcd):
    ctx = [registered_context(1, etcd, "ctxA", 2, r) for r in range(2)]
    g = generation(2, [], 1, "--registry", etcd.url, "--ctx-instance", "ctxA", "--requests", 8)
    rc, out = g.finish()
    s = summary(out)
    assert rc == 0 and s["ok"] == 8 and s["leaked"] == 0, out
    for c in ctx:
        assert f"{c.address} (incarnation {c.incarnation})" in out, out
    for c in ctx:
        rc, m = c.stop()
        assert rc == 0 and m["leaked_pages"] == 0 and m["registry"]["reachable"], m
    # Stopped ranks unregister: the instance is gone.
    rc, out = generation(2, [], 1, "--registry", etcd.url, "--ctx-instance", "ctxA",
                         "--timeout", 1).finish()
    assert rc != 0 and "no context rank of instance 'ctxA'" in out, out


def scrape(url):
    """A metrics endpoint's samples: {"name{labels}": value}."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in (l.rsplit(" ", 1) for l in text.splitlines()
                                      if l and not l.startswith("#"))}


def sample(samples, name, label=None):
    """The value of `name` (with `label`, e.g. 'outcome="ok"', among its labels)."""
    found = [v for k, v in samples.items()
             if k.startswith(name + "{") and (label is None or label in k)]
    assert len(found) == 1, (name, label, found)
    return found[0]


def test_a_restarted_context_rank_is_rediscovered_and_only_its_request_fails(etcd):
    old = registered_context(1, etcd, "ctxB")
    g = generation(2, [], 1, "--registry", etcd.url, "--ctx-instance", "ctxB", "--requests", 3000,
                   "--timeout", 20, "--metrics-port", 0, "--metrics-host", addr(2))
    g.line(r"found hxfer/ctxB/context/0")
    port = g.line(r"metrics on http://[0-9.]+:(\d+)/metrics")[1]
    metrics = f"http://{addr(2)}:{port}/metrics"
    time.sleep(1.0)
    before = scrape(metrics)
    old.kill()  # the host's process dies: no unregistering, its lease lives on for a while
    new = registered_context(1, etcd, "ctxB")
    assert new.incarnation != old.incarnation
    # The scrape keeps what the replaced connection counted: no counter goes back.
    deadline = time.monotonic() + 60
    while sample(after := scrape(metrics), "hxfer:instance_reconnects_total") < 1:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    for name, label in [("hxfer:requests_total", 'outcome="started"'),
                        ("hxfer:requests_total", 'outcome="ok"'), ("hxfer:bytes_total", None)]:
        assert sample(after, name, label) >= sample(before, name, label) > 0, (name, label)
    rc, out = g.finish(timeout=300)
    s = summary(out)
    reconnects = re.search(r"reconnects \d+", out)
    print(f"context restart: {s['ok']}/{s['asked']} verified, {reconnects and reconnects[0]}")
    assert f"incarnation {old.incarnation} -> {new.incarnation}" in out, out
    assert "reconnects 1" in out, out
    assert s["asked"] - s["ok"] <= 2 and s["leaked"] == 0, out  # the requests it had in flight
    rc, m = new.stop()
    assert rc == 0 and m["leaked_pages"] == 0, m


def test_etcd_stopped_and_restarted_while_transfers_run(etcd):
    c = registered_context(1, etcd, "ctxC")
    g = discovering_generation(etcd, "ctxC")
    time.sleep(0.5)
    etcd.stop()
    time.sleep(3.0)
    etcd.start()
    rc, out = g.finish(timeout=300)
    s = summary(out)
    errors = re.search(r"registry errors \d+", out)
    print(f"etcd down 3 s: {s['ok']}/{s['asked']} verified, {errors and errors[0]}")
    assert rc == 0 and s["ok"] == s["asked"] and s["leaked"] == 0, out
    assert "discovery paused" in out, out  # said once, when etcd went
    # The context rank is still (or again) registered: a new generation rank finds it.
    rc, out = generation(2, [], 1, "--registry", etcd.url, "--ctx-instance", "ctxC",
                         "--requests", 3).finish()
    assert rc == 0 and summary(out)["ok"] == 3, out
    time.sleep(2.5)  # a keep-alive round (every ttl/3) since etcd answered again
    rc, m = c.stop()
    assert rc == 0 and m["leaked_pages"] == 0, m
    assert m["registry"]["reachable"] and m["registry"]["errors"] > 0, m
