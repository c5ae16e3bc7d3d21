"""Context and generation instances of the tiny hybrid model around real hxfer Senders and
Receivers, and the comparison that makes the proof (docs/api.md).

A case: prefill a prompt at the context's (tp, pp, engine layout), write every rank's cache into
its pools (the engine's block table and slot), move the request with hxfer, read the cache out
of the generation instance's pools, decode there, and compare with
  - the unsharded run (tp 1, no transfer): the tokens, and the logits;
  - the same arithmetic without hxfer: the context's caches re-cut for the generation's TP by
    the model's own sharding (hybrid.reshard), decoded at the generation's TP. The caches read
    out of the pools must equal these bit for bit, and so must the logits.
"""

import dataclasses
import multiprocessing
import time

import numpy as np

from .hybrid import Model, RankCache, TensorParallel, reshard
from .records import RankPages

NUM_BLOCKS = 12
NUM_SLOTS = 5  # neither a block count nor a layer count
FP32 = dict(kv_dtype="fp32", conv_dtype="fp32", ssm_dtype="fp32")


@dataclasses.dataclass
class Side:
    """One instance's parallelism and engine layout."""
    engine: str
    tp: int = 1
    pp: int = 1
    tokens_per_block: int = 16
    options: dict = dataclasses.field(default_factory=dict)  # kv_layout, conv_layout, ...

    def __str__(self):
        opts = ",".join(f"{v}" for v in self.options.values())
        return (f"{self.engine}{'(' + opts + ')' if opts else ''} tp{self.tp}"
                f"{' pp' + str(self.pp) if self.pp > 1 else ''} T{self.tokens_per_block}")


def make_layout(config_path, side, pp_rank, tp_rank):
    import hxfer

    return hxfer.Layout.engine(side.engine, model=config_path, tp=side.tp, tp_rank=tp_rank,
                               pp=side.pp, pp_rank=pp_rank, num_blocks=NUM_BLOCKS,
                               num_slots=NUM_SLOTS, tokens_per_block=side.tokens_per_block,
                               **FP32, **side.options)


class Instance:
    """Every rank of one serving instance in this process: its layout and numpy pools, filled
    with `fill` bytes (0xFF: every float32 a NaN, so a byte hxfer did not move poisons the
    decode). Ranks in hxfer's peer order, pp_rank * tp + tp_rank."""

    def __init__(self, cfg, config_path, side, fill=0xFF):
        self.cfg, self.side = cfg, side
        self.ranks = []
        for s in range(side.pp):
            for r in range(side.tp):
                lay = make_layout(config_path, side, s, r)
                bufs = {p["name"]: np.full(p["bytes"], fill, np.uint8) for p in lay.pools()}
                self.ranks.append(RankPages(lay, cfg, bufs))
        self.check_stages()

    def check_stages(self):
        """Each layer with a cache lives on exactly one pp stage, the even split's."""
        L, pp = self.cfg.num_layers, self.side.pp
        for k, pages in enumerate(self.ranks):
            stage = k // self.side.tp
            want = [i for i in range(stage * L // pp, (stage + 1) * L // pp) if self.cfg.roles(i)]
            assert pages.layers == want, (pages.describe(), pages.layers, want)

    def tp_rank(self, k):
        return k % self.side.tp

    def write(self, caches, blocks, slot, tokens, roles=("kv", "conv", "ssm")):
        return sum(p.write(caches[self.tp_rank(k)], blocks, slot, tokens, roles)
                   for k, p in enumerate(self.ranks))

    def read(self, blocks, slot, tokens, max_tokens):
        caches = [RankCache(self.cfg, self.side.tp, r, max_tokens) for r in range(self.side.tp)]
        for k, p in enumerate(self.ranks):
            p.read(caches[self.tp_rank(k)], blocks, slot, tokens)
        return caches


def allocate_blocks(n, reserved=()):
    """An engine's block table: n free block ids in the order a free list hands them out
    (never block 0, sglang's dummy page)."""
    free = [b for b in (7, 3, 10, 5, 1, 11, 8, 2, 9, 4, 6) if b not in reserved]
    return free[:n]


def compare_caches(cfg, got, want, n_tokens):
    """Differences between two TP instances' caches, named by layer, role, section, global
    unit and rank (bitwise; kv over the first n_tokens tokens)."""
    diffs = []
    for r, (g, w) in enumerate(zip(got, want)):
        for i in range(cfg.num_layers):
            for role in cfg.roles(i):
                a, b = g.array(i, role), w.array(i, role)
                if role == "kv":
                    a, b = a[:, :, :n_tokens], b[:, :, :n_tokens]
                same = a.view(np.uint32) == b.view(np.uint32)
                if same.all():
                    continue
                row = 0
                for name, units, ulen in g.sections[(i, role)]:
                    for j, unit in enumerate(units):
                        if role == "kv":
                            ok = same[0 if name == "K" else 1, j].all()
                        elif role == "conv":
                            ok = same[row + j * ulen:row + (j + 1) * ulen].all()
                        else:
                            ok = same[j].all()
                        if not ok:
                            diffs.append(f"rank {r} layer {i} {role} section {name} unit {unit}")
                    row += len(units) * ulen if role == "conv" else 0
    return diffs


@dataclasses.dataclass
class Outcome:
    name: str
    tokens: list
    ref_tokens: list
    logits: np.ndarray
    ref_logits: np.ndarray
    same_arith_logits: np.ndarray
    cache_diffs: list
    bytes: int = 0
    seconds: float = 0.0

    @property
    def identical(self):
        return sum(a == b for a, b in zip(self.tokens, self.ref_tokens))

    @property
    def max_diff(self):
        return float(np.max(np.abs(self.logits.astype(np.float64) - self.ref_logits)))

    @property
    def bit_identical(self):
        return self.logits.shape == self.ref_logits.shape and np.array_equal(
            self.logits.view(np.uint32), self.ref_logits.view(np.uint32))

    @property
    def bit_identical_same_arith(self):
        return np.array_equal(self.logits.view(np.uint32),
                              self.same_arith_logits.view(np.uint32))

    def line(self):
        return (f"{self.name}: tokens identical: {self.identical}/{len(self.ref_tokens)}, "
                f"max logit diff vs unsharded {self.max_diff:.3g} "
                f"({'bit-identical' if self.bit_identical else 'not bit-identical'}), "
                f"vs same arithmetic without hxfer "
                f"{'bit-identical' if self.bit_identical_same_arith else 'DIFFERENT'}, "
                + (f"{self.bytes} B moved, {self.seconds:.2f} s" if self.bytes else
                   "no transfer"))


def unsharded(model, prompt, n_decode):
    tp = TensorParallel(model, 1)
    c = tp.new_cache(len(prompt) + n_decode)
    first = int(np.argmax(tp.prefill(c, prompt)[-1]))
    return tp.decode(c, first, len(prompt), n_decode)


class Case:
    """One proof case: the model, the two sides and the request."""

    def __init__(self, name, hf, config_path, ctx, gen, prompt_len=37, n_decode=8,
                 prefix_blocks=0, seed=3, processes=False, backend="inproc",
                 declare_prefix=True):
        """prefix_blocks: whole generation blocks of the prompt the generation side already
        holds (its own prefill wrote them; the context's copy is poisoned with NaN).
        declare_prefix=False asks hxfer for them anyway (prefix_tokens=0): a control that the
        poison is real."""
        self.name, self.hf, self.config_path = name, hf, config_path
        self.ctx, self.gen = ctx, gen
        self.prompt_len, self.n_decode, self.prefix_blocks = prompt_len, n_decode, prefix_blocks
        self.seed, self.processes, self.backend = seed, processes, backend
        self.declare_prefix = declare_prefix
        self.model = Model(hf, seed)
        self.cfg = self.model.cfg
        self.prompt = self.model.prompt(prompt_len, seed + 100)
        self.max_tokens = prompt_len + n_decode
        self.ctx_slot, self.gen_slot = 3, 1
        nb_ctx = -(-prompt_len // ctx.tokens_per_block)
        nb_gen = -(-self.max_tokens // gen.tokens_per_block)
        self.ctx_blocks = allocate_blocks(nb_ctx)
        self.gen_blocks = allocate_blocks(nb_gen)[::-1]
        self.prefix_tokens = prefix_blocks * gen.tokens_per_block

    # -- the context side --

    def prefill(self):
        """The context instance's TP prefill: its rank caches and the first token."""
        tp = TensorParallel(self.model, self.ctx.tp)
        caches = tp.new_cache(self.prompt_len)
        first = int(np.argmax(tp.prefill(caches, self.prompt)[-1]))
        return caches, first

    def context_instance(self, caches):
        inst = Instance(self.cfg, self.config_path, self.ctx, fill=0)
        inst.write(caches, self.ctx_blocks, self.ctx_slot, (0, self.prompt_len))
        if self.prefix_tokens:
            # The generation side holds the prefix: hxfer must not send it. Poison it here.
            nan = [RankCache(self.cfg, self.ctx.tp, r, self.prompt_len)
                   for r in range(self.ctx.tp)]
            for c in nan:
                for a in c.kv.values():
                    a[:] = np.nan
            inst.write(nan, self.ctx_blocks, self.ctx_slot, (0, self.prefix_tokens), ("kv",))
        return inst

    # -- the generation side --

    def generation_instance(self):
        inst = Instance(self.cfg, self.config_path, self.gen)
        prefix = None
        if self.prefix_tokens:
            # Its own prefill of the prefix put the prefix's kv in its pages.
            tp = TensorParallel(self.model, self.gen.tp)
            prefix = tp.new_cache(self.max_tokens)
            tp.prefill(prefix, self.prompt[:self.prefix_tokens])
            inst.write(prefix, self.gen_blocks, self.gen_slot, (0, self.prefix_tokens), ("kv",))
        return inst, prefix

    def run(self):
        t0 = time.monotonic()
        ref_tokens, ref_logits = unsharded(self.model, self.prompt, self.n_decode)
        ctx_caches, first = self.prefill()
        gen, prefix = self.generation_instance()
        moved, aux = transfer(self, gen, ctx_caches, first)
        assert aux == str(first).encode(), (aux, first)
        got = gen.read(self.gen_blocks, self.gen_slot, (0, self.prompt_len), self.max_tokens)
        want = reshard(self.cfg, ctx_caches, self.gen.tp, self.max_tokens)
        if prefix is not None:
            for w, p in zip(want, prefix):
                for i, a in w.kv.items():
                    a[:, :, :self.prefix_tokens] = p.kv[i][:, :, :self.prefix_tokens]
        diffs = compare_caches(self.cfg, got, want, self.prompt_len)
        tp = TensorParallel(self.model, self.gen.tp)
        tokens, logits = tp.decode(got, first, self.prompt_len, self.n_decode)
        _, same = tp.decode(want, first, self.prompt_len, self.n_decode)
        return Outcome(self.name, tokens, ref_tokens, logits, ref_logits, same, diffs, moved,
                       time.monotonic() - t0)

    def run_corrupted(self, corrupt):
        """A mover with a known bug: the context caches re-cut by `corrupt(cfg, ctx_caches,
        correct_gen_caches)`, written into the generation pages, read back and decoded."""
        ref_tokens, ref_logits = unsharded(self.model, self.prompt, self.n_decode)
        ctx_caches, first = self.prefill()
        want = reshard(self.cfg, ctx_caches, self.gen.tp, self.max_tokens)
        bad = corrupt(self.cfg, ctx_caches, reshard(self.cfg, ctx_caches, self.gen.tp,
                                                    self.max_tokens))
        gen = Instance(self.cfg, self.config_path, self.gen)
        gen.write(bad, self.gen_blocks, self.gen_slot, (0, self.prompt_len))
        got = gen.read(self.gen_blocks, self.gen_slot, (0, self.prompt_len), self.max_tokens)
        diffs = compare_caches(self.cfg, got, want, self.prompt_len)
        tp = TensorParallel(self.model, self.gen.tp)
        tokens, logits = tp.decode(got, first, self.prompt_len, self.n_decode)
        _, same = tp.decode(want, first, self.prompt_len, self.n_decode)
        return Outcome(self.name, tokens, ref_tokens, logits, ref_logits, same, diffs)


# ---- Bugs a mover could have (negative controls) ---------------------------------------------

def flat_conv(cfg, ctx_caches, gen_caches):
    """The conv state moved as one flat range: the context ranks' conv channels concatenated
    in rank order and cut into equal contiguous pieces for the generation ranks, instead of
    per section (x|B|C, Q|K|V)."""
    for i in range(cfg.num_layers):
        if "conv" not in cfg.roles(i):
            continue
        flat = np.concatenate([c.conv[i] for c in ctx_caches])
        at = 0
        for c in gen_caches:
            n = c.conv[i].shape[0]
            c.conv[i][:] = flat[at:at + n]
            at += n
    return gen_caches


def swap_b_and_c(cfg, ctx_caches, gen_caches):
    """Mamba2's B and C conv sections exchanged."""
    for c in gen_caches:
        for i in range(cfg.num_layers):
            if cfg.kinds[i] != "mamba2":
                continue
            secs = c.sections[(i, "conv")]
            (_, xu, xl), (_, bu, bl), _ = secs
            b0 = len(xu) * xl
            n = len(bu) * bl
            b = c.conv[i][b0:b0 + n].copy()
            c.conv[i][b0:b0 + n] = c.conv[i][b0 + n:b0 + 2 * n]
            c.conv[i][b0 + n:b0 + 2 * n] = b
    return gen_caches


# ---- Moving the request with hxfer ------------------------------------------------------------

REQUEST_ID = 16


def transfer(case, gen, ctx_caches, first):
    """Moves the request from the context instance to `gen` with hxfer. In-process (inproc)
    unless case.processes: then every context rank is a process of its own (multiprocessing
    spawn) that computes the prefill itself, writes its pools and serves them over
    case.backend. Returns (bytes moved, aux)."""
    import hxfer

    aux = str(first).encode()
    ucx = {"TLS": "tcp"} if case.backend == "ucx" else None
    senders, children = [], []
    if case.processes:
        mp = multiprocessing.get_context("spawn")
        for k in range(case.ctx.tp * case.ctx.pp):
            parent, child = mp.Pipe()
            p = mp.Process(target=context_rank_process, args=(
                child, case.hf, case.config_path, case.ctx, k // case.ctx.tp, k % case.ctx.tp,
                case.seed, case.prompt_len, case.ctx_blocks, case.ctx_slot, case.prefix_tokens,
                case.backend))
            p.start()
            children.append((p, parent))
        addresses = []
        for p, conn in children:
            if not conn.poll(60):
                raise AssertionError("context rank process silent for 60 s")
            msg = conn.recv()
            assert "error" not in msg, msg["error"]
            addresses.append(msg["address"])
    else:
        ctx = case.context_instance(ctx_caches)
        for pages in ctx.ranks:
            listen = {"listen": "127.0.0.1:0"} if case.backend == "ucx" else {}
            tx = hxfer.Sender(pages.layout, hxfer.Memory(pages.layout, pages.buffers),
                              backend=case.backend, ucx_options=ucx, instance="ctx", **listen)
            tx.mark_ready(REQUEST_ID, blocks=case.ctx_blocks, slot=case.ctx_slot, aux=aux)
            senders.append(tx)
        addresses = [tx.address for tx in senders]
    receivers = []
    try:
        for pages in gen.ranks:
            rx = hxfer.Receiver(pages.layout, hxfer.Memory(pages.layout, pages.buffers),
                                peers=addresses, peer_tp=case.ctx.tp, peer_pp=case.ctx.pp,
                                backend=case.backend, ucx_options=ucx, instance="gen")
            receivers.append(rx)
        for rx in receivers:
            rx.wait_for_peers(timeout=30.0)
        for rx in receivers:
            rx.start(REQUEST_ID, num_tokens=case.prompt_len, blocks=case.gen_blocks,
                     slot=case.gen_slot,
                     prefix_tokens=case.prefix_tokens if case.declare_prefix else 0)
        moved, auxes = 0, set()
        for k, rx in enumerate(receivers):
            res = rx.wait(REQUEST_ID, timeout=30.0)
            assert res.ok, f"generation rank {k}: {res.error}"
            moved += res.bytes
            auxes.add(bytes(res.aux))
            rx.release(REQUEST_ID)
        assert len(auxes) == 1, auxes
        return moved, auxes.pop()
    finally:
        for rx in receivers:
            rx.shutdown()
        for tx in senders:
            tx.shutdown()
        for p, conn in children:
            conn.send("quit")
        for p, conn in children:
            p.join(30)
            if p.exitcode is None:
                p.kill()
            assert p.exitcode == 0, f"context rank process exited with {p.exitcode}"


def context_rank_process(conn, hf, config_path, side, pp_rank, tp_rank, seed, prompt_len,
                         blocks, slot, prefix_tokens, backend):
    """A context rank in a process of its own: runs the instance's TP prefill (every rank's
    share, as the collective would), keeps its own rank's cache, writes it into its pools in
    its engine layout and serves the request until told to quit."""
    try:
        import hxfer

        model = Model(hf, seed)
        prompt = model.prompt(prompt_len, seed + 100)
        tp = TensorParallel(model, side.tp)
        caches = tp.new_cache(prompt_len)
        first = int(np.argmax(tp.prefill(caches, prompt)[-1]))
        lay = make_layout(config_path, side, pp_rank, tp_rank)
        bufs = {p["name"]: np.zeros(p["bytes"], np.uint8) for p in lay.pools()}
        pages = RankPages(lay, model.cfg, bufs)
        pages.write(caches[tp_rank], blocks, slot, (0, prompt_len))
        ucx = {"TLS": "tcp"} if backend == "ucx" else None
        tx = hxfer.Sender(lay, hxfer.Memory(lay, bufs), listen="127.0.0.1:0", backend=backend,
                          ucx_options=ucx, instance="ctx")
        tx.mark_ready(REQUEST_ID, blocks=blocks, slot=slot, aux=str(first).encode())
        conn.send({"address": tx.address})
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    conn.recv()
    tx.shutdown()
