#!/usr/bin/env python3
"""hxfer side by side with NIXL and Mooncake Transfer Engine: the same requests, in one run.

Every system moves the same request between the same two processes on this host, from the
same source pools into the same destination pools:

  hxfer-shm     hxfer's Sender/Receiver over its shm transport (memfd pools, both processes)
  hxfer-ucx     hxfer over UCX, UCX_TLS=tcp
  nixl          NIXL's UCX backend, UCX picking its transports (on one host: shared memory),
                one WRITE carrying every fragment, with a notification
  nixl-tcp      the same with UCX_TLS=tcp
  mooncake-tcp  Mooncake Transfer Engine, its TCP protocol, batch_transfer_sync_write of every
                fragment (P2P handshake, no metadata server)
  memcpy        baselines: one thread copying the request's bytes (one contiguous buffer),
  memcpy-x2     two threads, each half,
  tcp           and the bytes over one loopback TCP socket.

The fragments the peers write are hxfer's own plan of the request (hxfer.plan_transfer): the
maximal runs contiguous on both sides of the engine's scattered pages, the list an engine's
connector would build (per-block descriptors where blocks are scattered, per-token head runs
at a TP mismatch in a token-major layout). hxfer plans the same request itself inside its
Sender. Block ids are a random permutation on every rank, so runs do not merge across pages.

A timed run is one request's round trip as the generation side sees it: from asking (hxfer:
Receiver.start; NIXL: a notification to the context agent; Mooncake and TCP: a message on a
side-channel socket, as SGLang's connector does) to knowing every byte landed (hxfer: wait();
NIXL: the WRITE's notification; Mooncake and TCP: a reply once batch_transfer_sync_write or
sendall returned). The context side had its descriptors (or markReady) prepared before. After
every run the destination pools are compared, whole, with the expected bytes (the source
pattern placed by the fragments on a constant background): a system that wrote a byte wrong,
missed one or touched padding fails the run. Systems alternate within each repetition so they
share the machine's load; figures are the median and min..max of --repetitions runs after
--warmup dropped runs.

  bench/peers/run.sh --workloads large,tp4to1 --json peers.json --plot peers.svg

Settings from the environment: PEERS_NIXL_PROGRESS_THREAD=1 (NIXL's own progress thread; off
by default, see docs/performance.md), PEERS_MOONCAKE_BATCH (fragments per Mooncake batch,
2048), PEERS_HXFER_UCX="NAME=VALUE,..." (extra UCX settings of hxfer-ucx), PEERS_HXFER_SPIN=1
(the generation side spins on Receiver.poll() instead of sleeping in wait()).

Workloads (nemotron-h-8b unless --model; TensorRT-LLM's V1 block layout, 32-token pages,
except pages16):
  large      one request of 1k, 8k, 32k tokens (--tokens), ctx tp 1 -> gen tp 1
  tp4to1     8k tokens, ctx tp 4 -> gen tp 1 (one context process holds the four ranks)
  tp1to4     8k tokens, ctx tp 1 -> gen tp 4
  pages16    SGLang's token-major layout, 16-token pages, tp 4 -> 1 (a fragment per token and
             head run: the descriptor storm), 4k tokens
  latency    tiny-hybrid, one 32-token block: p50/p99 of the round trip
"""

import argparse
import base64
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTS = os.path.join(HERE, "..", "..", "scripts", "hosts.sh")
# What crosses hosts: shm (and UCX's shared-memory transports) reach only this host.
ACROSS_HOSTS = ["hxfer-ucx", "nixl-tcp", "mooncake-tcp", "tcp"]
SYSTEMS = ["hxfer-shm", "hxfer-ucx", "nixl", "nixl-tcp", "mooncake-tcp", "memcpy", "memcpy-x2",
           "tcp"]
PEERS = {"nixl", "nixl-tcp", "mooncake-tcp"}
BASELINES = {"memcpy", "memcpy-x2", "tcp"}
BACKGROUND = 0x5A  # destination bytes before every run
TIMEOUT = 120.0  # seconds a side waits for the other
TOKEN = "peers-bench"  # hxfer's shared secret between the two processes
# The generation side polls Receiver.poll() in a loop instead of sleeping in wait(), as the
# harness drives NIXL (PEERS_HXFER_SPIN=1): what a spinning caller would see.
HXFER_SPIN = os.environ.get("PEERS_HXFER_SPIN", "0") == "1"
# Extra UCX settings of hxfer-ucx, "NAME=VALUE,..." without the UCX_ prefix.
HXFER_UCX = dict(kv.split("=", 1) for kv in os.environ.get("PEERS_HXFER_UCX", "").split(",") if kv)
# Mooncake's TCP transport refuses a batch of more than a few thousand fragments (its lane
# queue is full, and the engine stays unusable after); larger requests go in batches this big.
MOONCAKE_BATCH = int(os.environ.get("PEERS_MOONCAKE_BATCH", "2048"))
# NIXL's own progress thread: off by default, since busy-polling check_xfer_state and the
# notifications (as this harness does) drives UCX faster on two cores; see docs/performance.md.
NIXL_PROGRESS_THREAD = os.environ.get("PEERS_NIXL_PROGRESS_THREAD", "0") == "1"


class Failure(Exception):
    pass


# ---- Workloads ----

def workloads(args):
    def spec(name, engine, ctx_tp, gen_tp, tokens, tpb=32, model=None, reps=None, **layout):
        return {"name": name, "engine": engine, "model": model or args.model, "ctx_tp": ctx_tp,
                "gen_tp": gen_tp, "tokens": tokens, "tokens_per_block": tpb, "layout": layout,
                "repetitions": reps or args.repetitions, "warmup": args.warmup,
                "seed": args.seed}

    out = []
    for name in args.workloads:
        if name == "large":
            out += [spec(f"large-{t // 1024}k", "trtllm-v1", 1, 1, t) for t in args.tokens]
        elif name == "tp4to1":
            out.append(spec("tp4to1-8k", "trtllm-v1", 4, 1, 8192))
        elif name == "tp1to4":
            out.append(spec("tp1to4-8k", "trtllm-v1", 1, 4, 8192))
        elif name == "pages16":
            out.append(spec("pages16-4k", "sglang", 4, 1, 4096, tpb=16))
        elif name == "latency":
            out.append(spec("latency-1block", "trtllm-v1", 1, 1, 32, model="tiny-hybrid",
                            reps=args.latency_rounds))
        else:
            raise SystemExit(f"--workloads: unknown workload '{name}' (large, tp4to1, tp1to4, "
                             "pages16, latency)")
    return out


# ---- One side's ranks: layouts, pools, pages, and the plan (both workers compute it) ----

class Side:
    def __init__(self, spec, role):
        import hxfer

        self.spec, self.role = spec, role
        tp = spec["ctx_tp"] if role == "ctx" else spec["gen_tp"]
        self.ctx_layouts = [self.layout(spec["ctx_tp"], r) for r in range(spec["ctx_tp"])]
        self.gen_layouts = [self.layout(spec["gen_tp"], r) for r in range(spec["gen_tp"])]
        self.layouts = self.ctx_layouts if role == "ctx" else self.gen_layouts
        self.ctx_pages = [self.pages(l, r, 1) for r, l in enumerate(self.ctx_layouts)]
        self.gen_pages = [self.pages(l, 100 + r, 0) for r, l in enumerate(self.gen_layouts)]
        self.pages_of = self.ctx_pages if role == "ctx" else self.gen_pages
        # Pools: SharedBuffers (so hxfer's shm can map them), one numpy view each.
        self.shared = [{p["name"]: hxfer.SharedBuffer(p["bytes"], p["name"]) for p in l.pools()}
                       for l in self.layouts]
        self.arrays = [[np.frombuffer(self.shared[r][p["name"]], np.uint8) for p in l.pools()]
                       for r, l in enumerate(self.layouts)]
        # The plan of every generation rank, from the whole context instance.
        self.plans = [hxfer.plan_transfer(self.ctx_layouts, self.ctx_pages, g, self.gen_pages[r],
                                          spec["tokens"])
                      for r, g in enumerate(self.gen_layouts)]
        self.bytes = sum(p["bytes"] for p in self.plans)
        self.fragments = sum(len(p["fragments"]) for p in self.plans)
        assert tp == len(self.layouts)

    def layout(self, tp, rank):
        import hxfer

        s = self.spec
        need = -(-s["tokens"] // s["tokens_per_block"])
        return hxfer.Layout.engine(s["engine"], model=s["model"], tp=tp, tp_rank=rank,
                                   num_blocks=need + 8, num_slots=2,
                                   tokens_per_block=s["tokens_per_block"], **s["layout"])

    def pages(self, layout, salt, slot):
        rng = np.random.default_rng([self.spec["seed"], salt])
        blocks = rng.permutation(layout.num_blocks)[:layout.blocks_for(self.spec["tokens"])]
        return ([int(b) for b in blocks], slot if layout.has_state else None)

    def source_pattern(self, rank, pool_index, n):
        rng = np.random.default_rng([self.spec["seed"], 7, rank, pool_index])
        return np.frombuffer(rng.bytes(n), np.uint8)

    def addresses(self):
        return [[a.ctypes.data for a in pools] for pools in self.arrays]


# ---- Worker processes ----

class Channel:
    """JSON lines to and from the driver on a private copy of stdout (fd 1 goes to stderr, so
    that the libraries' own prints cannot corrupt the protocol)."""

    def __init__(self):
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def say(self, obj):
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()


def recv_exact(sock, n):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise Failure("side channel closed")
        got += k
    return bytes(buf)


class Worker:
    def __init__(self, spec, role, systems, bind):
        self.spec, self.role, self.systems, self.bind = spec, role, systems, bind
        self.side = Side(spec, role)
        self.hx = {}  # system -> (senders or receivers, Released)
        self.nixl = {}  # system -> agent
        self.nixl_descs = {}  # system -> (local Nx3, remote Nx3) on ctx
        self.mooncake = None
        self.sock = None
        self.copy = None  # memcpy baselines: (source, destination), contiguous
        self.tcp_buffer = None  # the tcp baseline's bytes (sent, or received into)
        if role == "ctx":
            for r, pools in enumerate(self.side.arrays):
                for i, a in enumerate(pools):
                    a[:] = self.side.source_pattern(r, i, len(a))
        else:
            self.expected = self.expected_pools()
            for pools in self.side.arrays:
                for a in pools:
                    a.fill(BACKGROUND)

    def expected_pools(self):
        """The destination after a correct run: the background, and every fragment's source
        bytes at its destination."""
        s = self.side
        sources = [[s.source_pattern(r, i, p["bytes"]) for i, p in enumerate(l.pools())]
                   for r, l in enumerate(s.ctx_layouts)]
        out = []
        for g, plan in enumerate(s.plans):
            pools = [np.full(p["bytes"], BACKGROUND, np.uint8) for p in s.gen_layouts[g].pools()]
            for src, sp, so, dp, do, n in plan["fragments"].tolist():
                pools[dp][do:do + n] = sources[src][sp][so:so + n]
            out.append(pools)
        return out

    # -- setup, per system --

    def setup(self, cmd):
        system = cmd["system"]
        if system.startswith("hxfer-"):
            return self.setup_hxfer(system, cmd)
        if system.startswith("nixl"):
            return self.setup_nixl(system, cmd)
        if system == "mooncake-tcp":
            return self.setup_mooncake(cmd)
        if system in ("tcp", "side"):
            return self.setup_socket(cmd)
        if system.startswith("memcpy"):
            if self.copy is None:
                self.copy = (np.ones(self.side.bytes, np.uint8), np.zeros(self.side.bytes, np.uint8))
            return {}
        raise Failure(f"unknown system {system}")

    def setup_hxfer(self, system, cmd):
        import hxfer

        backend = system.split("-")[1]
        ucx = {"TLS": "tcp", **HXFER_UCX} if backend == "ucx" else None
        released = Released()
        ends = []
        for r, layout in enumerate(self.side.layouts):
            mem = hxfer.Memory(layout, self.side.shared[r])
            if self.role == "ctx":
                ends.append(hxfer.Sender(layout, mem, listen=f"{self.bind}:0", backend=backend, token=TOKEN,
                                         ucx_options=ucx, on_released=released, instance="ctx",
                                         lease_timeout=TIMEOUT))
            else:
                ends.append(hxfer.Receiver(layout, mem, peers=cmd["addresses"],
                                           peer_tp=self.spec["ctx_tp"], backend=backend, token=TOKEN,
                                           ucx_options=ucx, on_released=released, instance="gen",
                                           request_timeout=TIMEOUT))
        for e in ends:
            if self.role == "gen":
                e.wait_for_peers(timeout=30.0)
        self.hx[system] = (ends, released)
        return {"addresses": [e.address for e in ends]} if self.role == "ctx" else {}

    def setup_nixl(self, system, cmd):
        nixl_agent, nixl_agent_config = nixl_api()

        saved = os.environ.get("UCX_TLS")
        if system == "nixl-tcp":
            os.environ["UCX_TLS"] = "tcp"
        try:
            agent = nixl_agent(f"{self.role}-{system}", nixl_agent_config(
                enable_prog_thread=NIXL_PROGRESS_THREAD, backends=["UCX"]))
        finally:
            if saved is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = saved
        regs = [(a.ctypes.data, len(a), 0, "") for pools in self.side.arrays for a in pools]
        agent.register_memory(regs, "DRAM")
        self.nixl[system] = agent
        return {"metadata": base64.b64encode(agent.get_agent_metadata()).decode()}

    def nixl_connect(self, cmd):
        agent = self.nixl[cmd["system"]]
        peer = agent.add_remote_agent(base64.b64decode(cmd["remote"]))
        peer = peer.decode() if isinstance(peer, bytes) else peer  # notifications key by str
        if self.role == "ctx":
            s = self.side
            src = s.addresses()
            dst = cmd["gen_addresses"]
            local, remote = [], []
            for g, plan in enumerate(s.plans):
                f = plan["fragments"].astype(np.int64)
                src_base = np.array([src[r][p] for r, p in zip(f[:, 0], f[:, 1])], np.int64)
                dst_base = np.array([dst[g][p] for p in f[:, 3]], np.int64)
                zeros = np.zeros(len(f), np.int64)
                local.append(np.stack([src_base + f[:, 2], f[:, 5], zeros], axis=1))
                remote.append(np.stack([dst_base + f[:, 4], f[:, 5], zeros], axis=1))
            self.nixl_descs[cmd["system"]] = (peer, np.concatenate(local), np.concatenate(remote))
            agent.make_connection(peer)
        return {}

    def setup_mooncake(self, cmd):
        from mooncake.engine import TransferEngine

        te = TransferEngine()
        if te.initialize(self.bind, "P2PHANDSHAKE", "tcp", "") != 0:
            raise Failure(f"mooncake: initialize({self.bind}, P2PHANDSHAKE, tcp) failed")
        for pools in self.side.arrays:
            for a in pools:
                if te.register_memory(a.ctypes.data, len(a)) != 0:
                    raise Failure(f"mooncake: register_memory of {len(a)} bytes failed")
        self.mooncake = te
        if self.role == "ctx":
            s = self.side
            src, dst = s.addresses(), cmd["gen_addresses"]
            srcs, dsts, lens = [], [], []
            for g, plan in enumerate(s.plans):
                for r, sp, so, dp, do, n in plan["fragments"].tolist():
                    srcs.append(src[r][sp] + so)
                    dsts.append(dst[g][dp] + do)
                    lens.append(n)
            self.mooncake_session = cmd["session"]
            self.mooncake_lists = (srcs, dsts, lens)
            return {}
        return {"session": f"{self.bind}:{te.get_rpc_port()}"}

    def setup_socket(self, cmd):
        if self.sock is not None:
            return {}
        if self.role == "gen":
            listener = socket.socket()
            listener.bind((self.bind, 0))
            listener.listen(1)
            self.listener = listener
            return {"host": self.bind, "port": listener.getsockname()[1]}
        self.sock = socket.create_connection((cmd["host"], cmd["port"]))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.tcp_buffer = np.ones(self.side.bytes, np.uint8)
        return {}

    def accept(self, cmd):
        self.sock, _ = self.listener.accept()
        self.listener.close()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.tcp_buffer = np.zeros(self.side.bytes, np.uint8)
        return {}

    def pool_addresses(self, cmd):
        return {"addresses": self.side.addresses()}

    # -- the context side: prepared, then serves one request --

    def arm(self, channel, cmd):
        system, rid = cmd["system"], cmd["id"]
        s = self.side
        if system.startswith("hxfer-"):
            senders, released = self.hx[system]
            for r, tx in enumerate(senders):
                blocks, slot = s.ctx_pages[r]
                tx.mark_ready(rid, blocks, slot)
            channel.say({"armed": True})
            ok = released.wait_for(rid, TIMEOUT, count=len(senders))
            held = sum(tx.metrics()["requests_held"] for tx in senders)
            return {"served": ok, "requests_held": held}
        channel.say({"armed": True})
        if system.startswith("nixl"):
            agent = self.nixl[system]
            peer, local, remote = self.nixl_descs[system]
            go = f"go{rid}".encode()
            deadline = time.monotonic() + TIMEOUT
            while go not in agent.get_new_notifs().get(peer, []):
                if time.monotonic() > deadline:
                    raise Failure(f"{system}: no request {rid} from the generation side")
            h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"),
                                      agent.get_xfer_descs(remote, "DRAM"), peer,
                                      f"done{rid}".encode())
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            agent.release_xfer_handle(h)
            if state != "DONE":
                raise Failure(f"{system}: transfer state {state}")
            return {"served": True}
        if system == "mooncake-tcp":
            recv_exact(self.sock, 8)
            srcs, dsts, lens = self.mooncake_lists
            rc = 0
            for i in range(0, len(srcs), MOONCAKE_BATCH):
                j = i + MOONCAKE_BATCH
                rc = self.mooncake.batch_transfer_sync_write(self.mooncake_session, srcs[i:j],
                                                             dsts[i:j], lens[i:j])
                if rc != 0:
                    break
            self.sock.sendall(struct.pack("<q", rc))
            return {"served": rc == 0}
        if system == "tcp":
            recv_exact(self.sock, 8)
            self.sock.sendall(self.tcp_buffer)
            return {"served": True}
        return {"served": True}  # memcpy: the generation side alone

    # -- the generation side: one timed request --

    def run(self, cmd):
        system, rid = cmd["system"], cmd["id"]
        s = self.side
        t0 = time.perf_counter()
        moved = s.bytes
        if system.startswith("hxfer-"):
            receivers, released = self.hx[system]
            for r, rx in enumerate(receivers):
                blocks, slot = s.gen_pages[r]
                rx.start(rid, s.spec["tokens"], blocks, slot)
            if HXFER_SPIN:
                results = []
                for rx in receivers:
                    res = rx.poll(rid)
                    while res.state == "in_progress":
                        res = rx.poll(rid)
                    results.append(res)
            else:
                results = [rx.wait(rid, TIMEOUT) for rx in receivers]
            t1 = time.perf_counter()
            bad = [str(res.status) for res in results if not res.ok]
            if bad:
                raise Failure(f"{system}: request {rid} failed: {bad[0]}")
            moved = sum(res.bytes for res in results)
        elif system.startswith("nixl"):
            agent = self.nixl[system]
            peer = f"ctx-{system}"
            agent.send_notif(peer, f"go{rid}".encode())
            done = f"done{rid}".encode()
            deadline = time.monotonic() + TIMEOUT
            while done not in agent.get_new_notifs().get(peer, []):
                if time.monotonic() > deadline:
                    raise Failure(f"{system}: request {rid} never completed")
            t1 = time.perf_counter()
        elif system == "mooncake-tcp":
            self.sock.sendall(struct.pack("<q", rid))
            (rc,) = struct.unpack("<q", recv_exact(self.sock, 8))
            t1 = time.perf_counter()
            if rc != 0:
                raise Failure(f"mooncake-tcp: batch_transfer_sync_write returned {rc}")
        elif system == "tcp":
            self.sock.sendall(struct.pack("<q", rid))
            view, got = memoryview(self.tcp_buffer), 0
            while got < len(view):
                k = self.sock.recv_into(view[got:])
                if k == 0:
                    raise Failure("tcp: connection closed")
                got += k
            t1 = time.perf_counter()
        elif system == "memcpy":
            np.copyto(self.copy[1], self.copy[0])
            t1 = time.perf_counter()
        elif system == "memcpy-x2":
            src, dst = self.copy
            half = len(src) // 2
            th = threading.Thread(target=np.copyto, args=(dst[:half], src[:half]))
            th.start()
            np.copyto(dst[half:], src[half:])
            th.join()
            t1 = time.perf_counter()
        else:
            raise Failure(f"unknown system {system}")
        out = {"seconds": t1 - t0, "bytes": moved}
        if system not in BASELINES:
            out["verified"] = self.verify_and_reset(system)
        if system.startswith("hxfer-"):
            receivers, released = self.hx[system]
            for rx in receivers:
                rx.release(rid)
            out["requests_held"] = sum(rx.metrics()["requests_held"] for rx in receivers)
        return out

    def verify_and_reset(self, system):
        ok = True
        for pools, expected in zip(self.side.arrays, self.expected):
            for a, e in zip(pools, expected):
                if not np.array_equal(a, e):
                    diff = np.flatnonzero(a != e)
                    sys.stderr.write(f"{system}: {len(diff)} bytes differ, first at {diff[0]}\n")
                    ok = False
                a.fill(BACKGROUND)
        return ok

    def close(self):
        for ends, _ in self.hx.values():
            for e in ends:
                e.shutdown()
        if self.sock is not None:
            self.sock.close()


class Released:
    """on_released of every endpoint of one side: how often each id was released."""

    def __init__(self):
        self.counts = {}
        self.cv = threading.Condition()

    def __call__(self, rid):
        with self.cv:
            self.counts[rid] = self.counts.get(rid, 0) + 1
            self.cv.notify_all()

    def wait_for(self, rid, timeout, count=1):
        with self.cv:
            return self.cv.wait_for(lambda: self.counts.get(rid, 0) >= count, timeout)


def worker_main(role, spec_json, systems, bind):
    channel = Channel()
    try:
        w = Worker(json.loads(spec_json), role, systems, bind)
        channel.say({"bytes": w.side.bytes, "fragments": w.side.fragments})
    except Exception as e:  # reported to the driver, which names the workload
        channel.say({"error": f"{type(e).__name__}: {e}"})
        return 1
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "quit":
                break
            reply = {"setup": w.setup, "connect": w.nixl_connect, "accept": w.accept,
                     "addresses": w.pool_addresses, "run": w.run}.get(op)
            if op == "arm":
                channel.say(w.arm(channel, cmd))
            elif reply is not None:
                channel.say(reply(cmd))
            else:
                channel.say({"error": f"unknown op {op}"})
        except Exception as e:
            channel.say({"error": f"{type(e).__name__}: {e}"})
    w.close()
    return 0


# ---- The driver ----

class Proc:
    """A worker process; on host `host` of scripts/hosts.sh when given, bound to its address."""

    def __init__(self, role, spec, systems, env, host=None):
        self.role = role
        prefix, bind = [], "127.0.0.1"
        if host is not None:
            prefix, bind = [HOSTS, "exec", str(host)], host_address(host)
        self.p = subprocess.Popen(
            prefix + [sys.executable, os.path.abspath(__file__), "--worker", role, "--spec",
                      json.dumps(spec), "--systems", ",".join(systems), "--bind", bind],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def send(self, obj):
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def read(self):
        line = self.p.stdout.readline()
        if not line:
            raise Failure(f"{self.role} worker exited (code {self.p.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise Failure(f"{self.role} worker: {reply['error']}")
        return reply

    def ask(self, obj):
        self.send(obj)
        return self.read()

    def close(self):
        try:
            self.send({"op": "quit"})
            self.p.wait(timeout=30)
        except Exception:
            self.p.kill()
            self.p.wait()


def nixl_api():
    """NIXL's Python API: the `nixl` meta package's, or the CUDA 12 build's own module."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def host_address(host):
    return subprocess.run([HOSTS, "addr", str(host)], capture_output=True, text=True,
                          check=True).stdout.strip()


def available(systems):
    out = []
    for s in systems:
        try:
            if s.startswith("nixl"):
                nixl_api()
            elif s.startswith("mooncake"):
                import mooncake.engine  # noqa: F401
        except ImportError as e:
            print(f"# {s}: not installed ({e}); run bench/peers/setup.sh", file=sys.stderr)
            continue
        out.append(s)
    return out


def setup_systems(ctx, gen, systems):
    """Connects every system once, before any timed run: the side channel (Mooncake's and the
    tcp baseline's socket), hxfer's handshakes, NIXL's metadata exchange and connections, and
    the peers' descriptors of the generation pools."""
    side = gen.ask({"op": "setup", "system": "side"})
    ctx.ask({"op": "setup", "system": "side", "host": side["host"], "port": side["port"]})
    gen.ask({"op": "accept"})
    gen_addresses = gen.ask({"op": "addresses"})["addresses"]
    for s in systems:
        setup = {"op": "setup", "system": s}
        if s.startswith("hxfer-"):
            a = ctx.ask(setup)
            gen.ask({**setup, "addresses": a["addresses"]})
        elif s.startswith("nixl"):
            c, g = ctx.ask(setup), gen.ask(setup)
            gen.ask({"op": "connect", "system": s, "remote": c["metadata"]})
            ctx.ask({"op": "connect", "system": s, "remote": g["metadata"],
                     "gen_addresses": gen_addresses})
        elif s == "mooncake-tcp":
            g = gen.ask(setup)
            ctx.ask({**setup, "session": g["session"], "gen_addresses": gen_addresses})
        else:
            gen.ask(setup)


def percentile(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def run_workload(spec, systems, env, hosts=False):
    ctx = Proc("ctx", spec, systems, env, 1 if hosts else None)
    gen = Proc("gen", spec, systems, env, 2 if hosts else None)
    rows = []
    try:
        info_c, info_g = ctx.read(), gen.read()
        if info_c["bytes"] != info_g["bytes"]:
            raise Failure(f"the two sides planned {info_c['bytes']} and {info_g['bytes']} bytes")
        setup_systems(ctx, gen, systems)
        times = {s: [] for s in systems}
        moved, verified, held = {}, {s: 0 for s in systems}, {}
        rid = 1
        total = spec["warmup"] + spec["repetitions"]
        for rep in range(total):
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]
            for s in order:
                ctx.ask({"op": "arm", "system": s, "id": rid})
                r = gen.ask({"op": "run", "system": s, "id": rid})
                served = ctx.read()
                if not served.get("served"):
                    raise Failure(f"{s}: the context side did not serve request {rid}")
                if rep >= spec["warmup"]:
                    times[s].append(r["seconds"])
                    verified[s] += 1 if r.get("verified", True) else 0
                if r.get("verified") is False:
                    raise Failure(f"{s}: request {rid} arrived wrong (see the log above)")
                if r["bytes"] != info_g["bytes"]:
                    raise Failure(f"{s}: moved {r['bytes']} bytes, the plan has "
                                  f"{info_g['bytes']}")
                moved[s] = r["bytes"]
                if s.startswith("hxfer-"):
                    held[s] = (served.get("requests_held", 0), r.get("requests_held", 0))
                rid += 1
        for s in systems:
            t = times[s]
            med = percentile(t, 0.5)
            rows.append({"workload": spec["name"], "system": s, "bytes": info_g["bytes"],
                         "fragments": info_g["fragments"], "runs": len(t),
                         "median_ms": med * 1e3, "min_ms": min(t) * 1e3, "max_ms": max(t) * 1e3,
                         "p99_ms": percentile(t, 0.99) * 1e3,
                         "gbps": info_g["bytes"] / med / 1e9,
                         "verified": verified[s] if s not in BASELINES else None,
                         "requests_held": held.get(s)})
    finally:
        gen.close()
        ctx.close()
    return rows


def print_table(rows, out=sys.stdout):
    head = ("workload", "system", "MiB", "frags", "median ms", "min..max ms", "p99 ms", "GB/s",
            "checked")
    lines = [head]
    for r in rows:
        lines.append((r["workload"], r["system"], f"{r['bytes'] / 2**20:.1f}",
                      str(r["fragments"]), f"{r['median_ms']:.3f}",
                      f"{r['min_ms']:.3f}..{r['max_ms']:.3f}", f"{r['p99_ms']:.3f}",
                      f"{r['gbps']:.2f}",
                      "-" if r["verified"] is None else f"{r['verified']}/{r['runs']}"))
    widths = [max(len(l[i]) for l in lines) for i in range(len(head))]
    for l in lines:
        out.write("  ".join(c.rjust(w) for c, w in zip(l, widths)) + "\n")


def ratios(rows):
    """hxfer's best against each peer and the best peer, per workload (time ratio: > 1 means
    hxfer is faster)."""
    out = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        by = {r["system"]: r for r in rows if r["workload"] == w}
        hx = [by[s] for s in ("hxfer-shm", "hxfer-ucx") if s in by]
        peers = [by[s] for s in PEERS if s in by]
        entry = {"workload": w}
        if hx:
            best_hx = min(hx, key=lambda r: r["median_ms"])
            entry["hxfer"] = best_hx["system"]
            for p in peers:
                entry[p["system"]] = p["median_ms"] / best_hx["median_ms"]
            if peers:
                best = min(peers, key=lambda r: r["median_ms"])
                entry["best_peer"] = best["system"]
                entry["x_best_peer"] = best["median_ms"] / best_hx["median_ms"]
            if "hxfer-ucx" in by:  # the TCP paths against each other
                tcp_peers = [by[s] for s in ("nixl-tcp", "mooncake-tcp") if s in by]
                if tcp_peers:
                    best_tcp = min(tcp_peers, key=lambda r: r["median_ms"])
                    entry["ucx_x_best_tcp_peer"] = best_tcp["median_ms"] / by["hxfer-ucx"][
                        "median_ms"]
            for b in ("memcpy", "tcp"):
                if b in by:
                    entry[f"x_{b}"] = by[b]["median_ms"] / best_hx["median_ms"]
        out.append(entry)
    return out


def write_svg(path, rows, title):
    """Grouped bars: GB/s per system for each throughput workload; p50/p99 ms for latency."""
    colors = {"hxfer-shm": "#1f77b4", "hxfer-ucx": "#6baed6", "nixl": "#d62728",
              "nixl-tcp": "#ff9896", "mooncake-tcp": "#2ca02c", "memcpy": "#7f7f7f",
              "memcpy-x2": "#bdbdbd", "tcp": "#9467bd"}
    groups = list(dict.fromkeys(r["workload"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    w, h, left, top, plot_h = 140 * max(1, len(groups)) + 120, 460, 70, 50, 320
    bar = 110 / max(1, len(systems))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
             'font-family="sans-serif" font-size="11">',
             f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']

    def value(r):
        return r["median_ms"] if r["workload"].startswith("latency") else r["gbps"]

    vmax = {}
    for r in rows:
        kind = "ms" if r["workload"].startswith("latency") else "gbps"
        vmax[kind] = max(vmax.get(kind, 0), value(r))
    for gi, g in enumerate(groups):
        x0 = left + 140 * gi
        kind = "ms" if g.startswith("latency") else "gbps"
        for si, s in enumerate(systems):
            r = next((r for r in rows if r["workload"] == g and r["system"] == s), None)
            if r is None:
                continue
            bh = plot_h * value(r) / vmax[kind] if vmax[kind] else 0
            x = x0 + si * bar
            parts.append(f'<rect x="{x:.1f}" y="{top + plot_h - bh:.1f}" width="{bar - 2:.1f}" '
                         f'height="{bh:.1f}" fill="{colors.get(s, "#000")}"><title>{s}: '
                         f'{value(r):.3g} {"ms" if kind == "ms" else "GB/s"}</title></rect>')
            parts.append(f'<text x="{x + bar / 2:.1f}" y="{top + plot_h - bh - 3:.1f}" '
                         f'text-anchor="middle" font-size="8">{value(r):.2g}</text>')
        unit = "median ms (lower is better)" if kind == "ms" else "GB/s"
        parts.append(f'<text x="{x0 + 55}" y="{top + plot_h + 16}" text-anchor="middle">{g}'
                     f'</text><text x="{x0 + 55}" y="{top + plot_h + 30}" text-anchor="middle" '
                     f'font-size="9">{unit}</text>')
    y = top + plot_h + 50  # the legend, one row
    for si, s in enumerate(systems):
        x = left + si * 105
        parts.append(f'<rect x="{x}" y="{y}" width="10" height="10" '
                     f'fill="{colors.get(s, "#000")}"/><text x="{x + 14}" y="{y + 9}">{s}</text>')
    parts.append(f'<line x1="{left - 5}" y1="{top + plot_h}" x2="{w - 20}" '
                 f'y2="{top + plot_h}" stroke="black"/></svg>')
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def versions():
    out = {}
    try:
        from importlib.metadata import version
        for pkg in ("nixl", "nixl-cu12", "mooncake-transfer-engine-non-cuda", "numpy"):
            try:
                out[pkg] = version(pkg)
            except Exception:
                pass
    except ImportError:
        pass
    try:
        out["ucx"] = subprocess.run(["ucx_info", "-v"], capture_output=True, text=True,
                                    timeout=10).stdout.splitlines()[0]
    except Exception:
        pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--workloads", default="large,tp4to1,tp1to4,pages16,latency",
                    type=lambda s: s.split(","))
    ap.add_argument("--systems", default=",".join(SYSTEMS), type=lambda s: s.split(","))
    ap.add_argument("--model", default="nemotron-h-8b")
    ap.add_argument("--tokens", default="1024,8192,32768",
                    type=lambda s: [int(x) for x in s.split(",")],
                    help="request lengths of the large workload")
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--latency-rounds", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write rows, ratios and versions to FILE")
    ap.add_argument("--plot", help="write an SVG bar chart to FILE")
    ap.add_argument("--hosts", action="store_true",
                    help="the two processes on two hosts made of network namespaces "
                         "(scripts/hosts.sh, root): only what crosses hosts runs (" +
                         ", ".join(ACROSS_HOSTS) + ")")
    ap.add_argument("--worker", choices=["ctx", "gen"], help=argparse.SUPPRESS)
    ap.add_argument("--bind", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args.worker, args.spec, args.systems, args.bind)

    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown system '{unknown[0]}' ({', '.join(SYSTEMS)})")
    systems = available(args.systems)
    if args.hosts:
        dropped = [s for s in systems if s not in ACROSS_HOSTS]
        if dropped:
            print(f"# --hosts: {', '.join(dropped)} reach only this host; not run",
                  file=sys.stderr)
        systems = [s for s in systems if s in ACROSS_HOSTS]
        subprocess.run([HOSTS, "up", "2"], check=True)
    env = dict(os.environ)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.setdefault("GLOG_minloglevel", "2")  # Mooncake's logging: errors only
    rows, failures = [], []
    for spec in workloads(args):
        t = time.monotonic()
        print(f"# {spec['name']}: {spec['model']} {spec['engine']} ctx tp {spec['ctx_tp']} -> "
              f"gen tp {spec['gen_tp']}, {spec['tokens']} tokens, {spec['repetitions']} runs",
              file=sys.stderr, flush=True)
        try:
            got = run_workload(spec, systems, env, args.hosts)
        except Failure as e:
            failures.append(f"{spec['name']}: {e}")
            print(f"# {spec['name']} FAILED: {e}", file=sys.stderr, flush=True)
            continue
        print_table(got, sys.stderr)
        print(f"# {spec['name']}: {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)
        rows += got
    if args.hosts:
        subprocess.run([HOSTS, "down"], check=False)
    print_table(rows)
    rat = ratios(rows)
    for r in rat:
        print(json.dumps(r))
    info = {"versions": versions(), "hosts": "two network namespaces" if args.hosts else "one",
            "ucx_tls": {"hxfer-ucx": "tcp", "nixl": "(UCX's choice)", "nixl-tcp": "tcp"}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ratios": rat, "failures": failures, **info}, f, indent=1)
    if args.plot:
        where = "two hosts (network namespaces)" if args.hosts else "one host"
        write_svg(args.plot, rows, f"hxfer and its peers, {where}, same requests")
    for f in failures:
        print("FAILED " + f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
