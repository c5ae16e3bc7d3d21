#!/usr/bin/env python3
"""Two serving engines end to end through hxfer's Python API.

  context instance     vLLM's layout at tp 2: two processes (multiprocessing, "spawn"), each
                       a context rank with its own numpy pools and an hxfer.Sender.
  generation instance  TensorRT-LLM's KVCacheManagerV2 layout ("trtllm-v2") at tp 1: this
                       process, numpy pools and an hxfer.Receiver.

Each side allocates its pages itself, from a free list per pool kind (blocks, slots) that
takes a page back only when hxfer's on_released fired for the request that held it: hxfer
fences pages, it never allocates them. Requests run in batches; some are cancelled at random
(--seed): by the context side before its pages are marked ready, or by the generation side
right after it asked.

How every byte is checked: a round trip. A context rank fills a request's pages with bytes
derived from (seed, request id, rank). Once the generation rank has the request, it copies the
request's records into a second set of pools in its own layout and sends them back with a
second Sender; each context rank receives them with a second Receiver into check pools whose
pages it pre-filled with the complement of the pattern. Every check byte must then be the
pattern (it went there and back to the right place) or its complement (never written: vLLM's
Mamba page padding, the rest of a partial last block), and the bytes equal to the pattern must
number exactly what hxfer reports moved, on the way back and, summed over both ranks, on the
way out. Where a request's records lie in a pool comes from Layout.pools(): rows of blocks, of
slots, or of layers holding every slot's record.

At the end every request is released on both sides: holds() is false for every id, every
allocator has all its pages back, and metrics() shows requests_held 0, in this process and in
both context processes, which report their own accounting over a multiprocessing Queue.

  PYTHONPATH=build/python python3 examples/python/engine_pair.py --requests 100
"""

import argparse
import multiprocessing as mp
import queue
import random
import secrets
import sys
import threading
import time
import traceback

import numpy as np

import hxfer

CTX_ENGINE, CTX_TP = "vllm", 2
GEN_ENGINE = "trtllm-v2"
REPLY_TIMEOUT = 60.0  # seconds a side waits for the other before calling it a failure


class Failure(Exception):
    pass


# ---- Where a request's records lie (from Layout.pools()) ----

def record_spans(layout, pool, blocks, slot):
    """(offset, length) of the request's records in `pool`, in a fixed order."""
    rows, pitch = pool["shape"][0], pool["strides"][0]
    if rows == layout.num_blocks:
        return [(b * pitch, pitch) for b in blocks]
    if rows == layout.num_slots:
        return [(slot * pitch, pitch)]
    record = pitch // layout.num_slots  # layer-major: a row per layer, every slot in it
    return [(row * pitch + slot * record, record) for row in range(rows)]


def gather(layout, pools, blocks, slot):
    return np.concatenate([pools[p["name"]][o:o + n] for p in layout.pools()
                           for o, n in record_spans(layout, p, blocks, slot)])


def scatter(layout, pools, blocks, slot, data):
    at = 0
    for p in layout.pools():
        for o, n in record_spans(layout, p, blocks, slot):
            pools[p["name"]][o:o + n] = data[at:at + n]
            at += n


def span_bytes(layout, blocks, slot):
    return sum(n for p in layout.pools() for _, n in record_spans(layout, p, blocks, slot))


def pattern(n, seed, request_id, rank):
    return np.frombuffer(np.random.default_rng([seed, request_id, rank]).bytes(n), np.uint8)


def make_layout(engine, args, tp=1, tp_rank=0):
    # The two engines must keep each state in one dtype: their own defaults differ (TensorRT-LLM
    # keeps ssm state in the model dtype, vLLM in fp32 for NemotronH), so name them.
    return hxfer.Layout.engine(engine, model=args["model"], tp=tp, tp_rank=tp_rank,
                               num_blocks=args["blocks"], num_slots=args["slots"],
                               tokens_per_block=args["tokens_per_block"], conv_dtype="bf16",
                               ssm_dtype="fp32")


def allocate_pools(layout, kind):
    """The engine's pools: numpy arrays it reads and writes, and what it registers with hxfer
    (the same arrays, or the hxfer.SharedBuffer under each, which shm can share)."""
    if kind == "numpy":
        arrays = {p["name"]: np.zeros(p["bytes"], np.uint8) for p in layout.pools()}
        return arrays, arrays
    shared = {p["name"]: hxfer.SharedBuffer(p["bytes"], p["name"]) for p in layout.pools()}
    return {name: np.frombuffer(sb, np.uint8) for name, sb in shared.items()}, shared


# ---- The engines' page allocator ----

class FreeList:
    """One engine's pages of one kind. Pages go back only through `released(request_id)`,
    which the engine calls from hxfer's on_released: a page is never reused while hxfer may
    still write into or out of it."""

    def __init__(self, name, capacity):
        self.name, self.capacity = name, capacity
        self._free = list(range(capacity))
        self._held = {}  # request id -> pages
        self._cv = threading.Condition()

    def take(self, request_id, n, timeout=REPLY_TIMEOUT):
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._free) >= n, timeout):
                raise Failure(f"{self.name}: no {n} free pages in {timeout} s "
                              f"({len(self._held)} requests hold the rest)")
            pages = [self._free.pop(random.randrange(len(self._free))) for _ in range(n)]
            self._held[request_id] = pages
            return pages

    def released(self, request_id):
        with self._cv:
            self._free += self._held.pop(request_id, [])
            self._cv.notify_all()

    def holding(self, request_id):
        with self._cv:
            return request_id in self._held

    def wait_all_free(self, timeout):
        with self._cv:
            return self._cv.wait_for(lambda: len(self._free) == self.capacity, timeout)


class Pages:
    """Block and slot free lists of one set of pools; `on_released` is hxfer's callback."""

    def __init__(self, name, layout):
        self.layout = layout
        self.blocks = FreeList(name + " blocks", layout.num_blocks)
        self.slots = FreeList(name + " slots", layout.num_slots)
        self.released_ids = set()

    def take(self, request_id, num_tokens):
        blocks = self.blocks.take(request_id, self.layout.blocks_for(num_tokens))
        return blocks, self.slots.take(request_id, 1)[0]

    def on_released(self, request_id):
        self.released_ids.add(request_id)
        self.blocks.released(request_id)
        self.slots.released(request_id)

    def wait_all_free(self, timeout=10.0):
        return self.blocks.wait_all_free(timeout) and self.slots.wait_all_free(timeout)

    def holding(self, request_id):
        return self.blocks.holding(request_id) or self.slots.holding(request_id)


def transport(args):
    opts = {"backend": args["backend"], "token": args["token"], "instance": "engine-pair"}
    if args["backend"] in ("auto", "ucx") and args["ucx_tls"]:
        opts["ucx_options"] = {"TLS": args["ucx_tls"]}
    return opts


# ---- A context rank (a process of its own) ----

def context_rank(rank, args, commands, replies):
    try:
        _context_rank(rank, args, commands, replies)
    except (Failure, hxfer.Error) as e:  # report, never hang the parent
        replies.put(("error", rank, f"context rank {rank}: {e}"))
        sys.exit(1)
    except BaseException as e:
        replies.put(("error", rank, f"context rank {rank}: {e!r}\n{traceback.format_exc()}"))
        sys.exit(1)


def _context_rank(rank, args, commands, replies):
    random.seed(args["seed"] * 1000 + rank)
    lay = make_layout(CTX_ENGINE, args, tp=CTX_TP, tp_rank=rank)
    (src, src_mem), (check, check_mem) = (allocate_pools(lay, args["pools"]) for _ in range(2))
    src_pages, check_pages = Pages(f"context rank {rank}", lay), Pages(f"check rank {rank}", lay)
    tx = hxfer.Sender(lay, hxfer.Memory(lay, src_mem), listen="127.0.0.1:0",
                      on_released=src_pages.on_released, **transport(args))
    replies.put(("address", rank, tx.address))
    back = None
    seen, verified, cancelled = set(), 0, 0
    while True:
        op, *rest = commands.get(timeout=REPLY_TIMEOUT)
        if op == "return-address":  # the generation instance's return sender
            back = hxfer.Receiver(lay, hxfer.Memory(lay, check_mem), peers=[rest[0]], peer_tp=1,
                                  on_released=check_pages.on_released, **transport(args))
            back.wait_for_peers(timeout=REPLY_TIMEOUT)
            replies.put(("ready", rank, None))
        elif op == "prefill":
            request_id, num_tokens, cancel_first = rest
            seen.add(request_id)
            blocks, slot = src_pages.take(request_id, num_tokens)
            fill = pattern(span_bytes(lay, blocks, slot), args["seed"], request_id, rank)
            scatter(lay, src, blocks, slot, fill)  # "prefill wrote the pages"
            if cancel_first:
                tx.cancel(request_id)
            try:
                tx.mark_ready(request_id, blocks, slot, aux=f"token-{request_id}".encode())
            except hxfer.Error as e:
                if not (cancel_first and e.code == "Cancelled"):
                    raise
                cancelled += 1
                # hxfer adopted the pages and gave them back; on_released says so.
                if not wait_for(lambda: not src_pages.holding(request_id)):
                    raise Failure(f"request {request_id}: cancelled before ready, pages never "
                                  f"released") from e
                replies.put(("cancelled", rank, request_id))
                continue
            replies.put(("marked", rank, request_id))
        elif op == "abort":  # the generation side cancelled: the engine drops the request
            tx.cancel(rest[0])
            replies.put(("aborted", rank, rest[0]))
        elif op == "check":
            request_id, num_tokens, source_blocks = rest
            blocks, slot = check_pages.take(request_id, num_tokens)
            sent = pattern(span_bytes(lay, blocks, slot), args["seed"], request_id, rank)
            assert source_blocks == len(blocks)
            scatter(lay, check, blocks, slot, ~sent)
            back.start(request_id, num_tokens, blocks, slot)
            res = back.wait(request_id, timeout=REPLY_TIMEOUT)
            if not res.ok:
                raise Failure(f"request {request_id}: return trip {res.state}: {res.error}")
            got = gather(lay, check, blocks, slot)
            arrived = got == sent
            wrong = int((~arrived & (got != ~sent)).sum())
            if wrong or int(arrived.sum()) != res.bytes:
                raise Failure(f"request {request_id} rank {rank}: {wrong} bytes wrong, "
                              f"{int(arrived.sum())} of {res.bytes} arrived")
            back.release(request_id)
            verified += res.bytes
            replies.put(("checked", rank, (request_id, res.bytes)))
        elif op == "finish":
            ok = src_pages.wait_all_free() and check_pages.wait_all_free()
            replies.put(("accounting", rank, {
                "pages_free": ok,
                "held": sorted(i for i in seen if tx.holds(i) or back.holds(i)),
                "requests_held": tx.metrics()["requests_held"] + back.metrics()["requests_held"],
                "released": len(src_pages.released_ids),
                "seen": len(seen), "verified": verified, "cancelled": cancelled,
                "requests_ok": tx.metrics()["requests_ok"],
            }))
        elif op == "exit":
            back.shutdown()
            tx.shutdown()
            return


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


# ---- The generation instance (this process) ----

class ContextInstance:
    """The two context processes, spoken to through queues."""

    def __init__(self, args):
        ctx = mp.get_context("spawn")
        self.replies = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(CTX_TP)]
        self.procs = [ctx.Process(target=context_rank, args=(r, args, self.commands[r],
                                                             self.replies), daemon=True)
                      for r in range(CTX_TP)]
        for p in self.procs:
            p.start()

    def send(self, *cmd):
        for q in self.commands:
            q.put(cmd)

    def collect(self, n):
        """n replies, as (kind, rank, payload)."""
        out = []
        deadline = time.monotonic() + REPLY_TIMEOUT
        while len(out) < n:
            try:
                reply = self.replies.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise Failure(f"context ranks {dead} exited" if dead else
                                  f"context instance silent for {REPLY_TIMEOUT} s") from None
                continue
            if reply[0] == "error":
                raise Failure(reply[2])
            out.append(reply)
        return out

    def join(self):
        for p in self.procs:
            p.join(timeout=REPLY_TIMEOUT)
        return [p.exitcode for p in self.procs]

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()


def run(args):
    rng = random.Random(args["seed"])
    random.seed(args["seed"])
    lay = make_layout(GEN_ENGINE, args)
    (gen, gen_mem), (mirror, mirror_mem) = (allocate_pools(lay, args["pools"]) for _ in range(2))
    gen_pages, mirror_pages = Pages("generation", lay), Pages("return", lay)
    ctx = ContextInstance(args)
    try:
        addresses = dict((rank, a) for _, rank, a in ctx.collect(CTX_TP))
        rx = hxfer.Receiver(lay, hxfer.Memory(lay, gen_mem),
                            peers=[addresses[r] for r in range(CTX_TP)],
                            on_released=gen_pages.on_released, **transport(args))
        back = hxfer.Sender(lay, hxfer.Memory(lay, mirror_mem), listen="127.0.0.1:0",
                            on_released=mirror_pages.on_released, **transport(args))
        ctx.send("return-address", back.address)
        ctx.collect(CTX_TP)
        rx.wait_for_peers(timeout=REPLY_TIMEOUT)

        max_tokens = 3 * args["tokens_per_block"]
        cancelled = verified = 0
        ids = list(range(1, args["requests"] + 1))
        for first in range(0, len(ids), args["batch"]):
            batch = ids[first:first + args["batch"]]
            plan = {}
            for rid in batch:
                roll = rng.random()
                mode = "ctx" if roll < args["cancel"] / 2 else "gen" if roll < args["cancel"] \
                    else None
                plan[rid] = (rng.randint(1, max_tokens), mode)
                ctx.send("prefill", rid, plan[rid][0], mode == "ctx")
            marked = {}
            for kind, rank, rid in ctx.collect(CTX_TP * len(batch)):
                marked.setdefault(rid, set()).add(kind)
            started = []
            for rid in batch:
                num_tokens, mode = plan[rid]
                if marked[rid] == {"cancelled"}:
                    cancelled += 1
                    continue
                if marked[rid] != {"marked"}:
                    raise Failure(f"request {rid}: context ranks answered {marked[rid]}")
                blocks, slot = gen_pages.take(rid, num_tokens)
                rx.start(rid, num_tokens, blocks, slot)
                if mode == "gen":
                    rx.cancel(rid)
                started.append((rid, blocks, slot))
            checks = aborts = 0
            moved = {}
            for rid, blocks, slot in started:
                num_tokens, mode = plan[rid]
                res = rx.wait(rid, timeout=REPLY_TIMEOUT)
                if res.state == "failed" and mode == "gen" and res.code == "Cancelled":
                    cancelled += 1
                    rx.release(rid)  # forgets the result; hxfer releases the pages itself
                    ctx.send("abort", rid)
                    aborts += CTX_TP
                    continue
                if not res.ok:
                    raise Failure(f"request {rid}: {res.state}: {res.error}")
                if res.aux != f"token-{rid}".encode():
                    raise Failure(f"request {rid}: aux {res.aux!r}")
                moved[rid] = res.bytes
                # Send it back for the check, out of pools of its own.
                mblocks, mslot = mirror_pages.take(rid, num_tokens)
                records = gather(lay, gen, blocks, slot)
                if rid == args["corrupt"]:  # shows the check bites
                    records[len(records) // 2] ^= 0x5A
                scatter(lay, mirror, mblocks, mslot, records)
                rx.release(rid)
                back.mark_ready(rid, mblocks, mslot)
                ctx.send("check", rid, num_tokens, len(blocks))
                checks += CTX_TP
            returned = {}
            for kind, rank, payload in ctx.collect(checks + aborts):
                if kind == "checked":
                    rid, nbytes = payload
                    returned[rid] = returned.get(rid, 0) + nbytes
                    verified += nbytes
            for rid, nbytes in moved.items():
                if returned.get(rid) != nbytes:
                    raise Failure(f"request {rid}: {nbytes} bytes went out, "
                                  f"{returned.get(rid)} came back")

        # Accounting: every request released on both sides, every page back.
        problems = []
        if not (gen_pages.wait_all_free() and mirror_pages.wait_all_free()):
            problems.append("generation pages not all released")
        held = [i for i in ids if rx.holds(i) or back.holds(i)]
        if held:
            problems.append(f"generation still holds {held}")
        for name, side in (("receiver", rx), ("return sender", back)):
            if side.metrics()["requests_held"] != 0:
                problems.append(f"generation {name} metrics: {side.metrics()['requests_held']} "
                                "requests held")
        ctx.send("finish")
        ctx_cancelled = set()
        for _, rank, acct in ctx.collect(CTX_TP):
            if not acct["pages_free"] or acct["held"] or acct["requests_held"]:
                problems.append(f"context rank {rank}: {acct}")
            if acct["seen"] != len(ids) or acct["released"] != len(ids):
                problems.append(f"context rank {rank}: saw {acct['seen']} requests, "
                                f"{acct['released']} released, of {len(ids)}")
            ctx_cancelled.add(acct["cancelled"])
        if problems:
            raise Failure("pages not accounted: " + "; ".join(problems))
        rx.shutdown()
        ctx.send("exit")
        codes = ctx.join()
        back.shutdown()
        if codes != [0] * CTX_TP:
            raise Failure(f"context processes exited with {codes}")
        return len(ids), cancelled, verified
    finally:
        ctx.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--backend", default="auto", help="auto | ucx | shm (default auto)")
    ap.add_argument("--pools", choices=["numpy", "shared"], default="numpy",
                    help="numpy arrays (private: ucx), or numpy views of hxfer.SharedBuffer "
                    "(shareable: auto picks shm)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", default="tiny-hybrid", help="a preset or a config.json path")
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=40, help="kv blocks of each pool set")
    ap.add_argument("--slots", type=int, default=12, help="state slots of each pool set")
    ap.add_argument("--batch", type=int, default=8, help="requests in flight together")
    ap.add_argument("--cancel", type=float, default=0.2, help="share of requests cancelled")
    ap.add_argument("--ucx-tls", default="tcp", help="UCX transports ('': UCX's default)")
    ap.add_argument("--corrupt", type=int, default=0, help=argparse.SUPPRESS)  # tests only
    a = ap.parse_args()
    if a.backend == "shm" and a.pools == "numpy":
        ap.error("--backend shm needs shareable pools: add --pools shared")
    if a.blocks == a.slots:
        ap.error("--blocks and --slots must differ (pools() rows are told apart by count)")
    args = {"requests": a.requests, "backend": a.backend, "seed": a.seed, "model": a.model,
            "tokens_per_block": a.tokens_per_block, "blocks": a.blocks, "slots": a.slots,
            "batch": a.batch, "cancel": a.cancel, "ucx_tls": a.ucx_tls, "pools": a.pools,
            "corrupt": a.corrupt,
            "token": secrets.token_hex(16)}
    try:
        n, cancelled, verified = run(args)
    except (Failure, hxfer.Error) as e:
        print(f"engine_pair: FAILED: {e}", file=sys.stderr)
        return 1
    print(f"engine_pair: {n} requests, {cancelled} cancelled, {verified} bytes verified, "
          "pages accounted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
