"""A tiny hybrid language model, computed for real in numpy, under tensor parallelism.

The model is read from a Hugging Face config.json (the same file hxfer.Layout.engine reads):
NemotronHForCausalLM (hybrid_override_pattern: M mamba2, * attention, - MLP) or
Qwen3NextForCausalLM (layer_types: linear_attention = gated delta net, full_attention).
Weights are drawn from a seed. Layers are pre-norm residual blocks; then a final RMS norm and
the LM head; decoding is greedy.

Tensor parallelism is simulated the way serving engines (vLLM, SGLang, TensorRT-LLM) shard a
layer: every input projection is column-parallel and split per section (attention Q by heads,
K and V by kv heads, replicated when kv heads < tp; Mamba2 z, x and dt by heads, B and C by
groups, replicated when n_groups < tp; gated delta net Q and K by key heads, V, z, b, a by value
heads), the conv1d weights follow their channels, and every output projection is row-parallel:
each rank computes a partial output and the partials are summed across ranks (the all-reduce).
Mamba2's gated RMS norm is per group, so a group spread over several ranks all-reduces its
sum of squares too. Which units a rank holds (rank_sections) is derived from what its heads
need (a replicated kv head or group is the one the rank's query heads or Mamba heads use), not
from hxfer's rule, so that the proof compares the two.

Numerics: every computation runs in float64; what the cache holds (K and V after rotary, the
conv inputs, the SSM state) and the residual stream and logits are rounded to float32 at the
points an engine stores them. A rank's cache is therefore float32 throughout (moved as fp32,
bit for bit), prefill is the decode step run token by token (the same arithmetic), and a TP
split changes only float64 summation orders below float32's resolution: the float32 results of
different TP sizes agree bit for bit unless a value falls within ~1e-16 of a float32 rounding
boundary (checked per case, not assumed).

Cache of one rank (RankCache), per layer with a cache:
  kv    float32 (2, local kv heads, max_tokens, head_dim); [0] = K, [1] = V, token = position
  conv  float32 (local channels, d_conv - 1); channels in section order (x|B|C or Q|K|V, each
        the rank's units in increasing global order, unit_len channels each); window 0 is the
        oldest kept input, d_conv - 2 the newest
  ssm   float32 mamba2 (local heads, head_dim, d_state); gdn (local value heads, key, value)
"""

import json
import pathlib

import numpy as np

F64 = np.float64


def r32(a):
    """Rounds to float32 (what a cache or the residual stream stores)."""
    return np.asarray(a, F64).astype(np.float32)


def silu(x):
    return x / (1.0 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0.0, x)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


# ---- Configs -------------------------------------------------------------------------------

def nemotron_h_config(**over):
    """A tiny NemotronH: mamba2 (8 heads x 8, 2 groups of state 4, so n_groups < tp at tp 4),
    GQA attention (8 query heads, 2 kv heads of 8, replicated at tp 4), an MLP layer. Inner
    sizes differ from each other (head_dim 8, d_state 4, window 3) so that a transposed inner
    dim cannot pass."""
    c = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "hybrid_override_pattern": "M*-M*M",
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "n_groups": 2,
        "ssm_state_size": 4,
        "conv_kernel": 4,
        "vocab_size": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    }
    c.update(over)
    c["num_hidden_layers"] = len(c["hybrid_override_pattern"])
    return c


def qwen3_next_config(**over):
    """A tiny Qwen3-Next: gated delta net (4 key heads of 8, 8 value heads of 4), attention
    with 4 query heads and 2 kv heads of 16."""
    c = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention",
                        "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 4,
        "linear_conv_kernel_dim": 4,
        "vocab_size": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    }
    c.update(over)
    c["num_hidden_layers"] = len(c["layer_types"])
    return c


def write_config(hf, directory, name):
    """Writes `hf` as <directory>/<name>/config.json; returns the path (hxfer's model=)."""
    d = pathlib.Path(directory) / name
    d.mkdir(parents=True, exist_ok=True)
    path = d / "config.json"
    path.write_text(json.dumps(hf, indent=1))
    return str(path)


class Config:
    """The fields of a config.json the model uses."""

    def __init__(self, hf):
        self.hf = hf
        self.arch = hf["architectures"][0]
        self.hidden = hf["hidden_size"]
        self.vocab = hf["vocab_size"]
        self.eps = hf.get("rms_norm_eps", 1e-5)
        self.rope_theta = hf.get("rope_theta", 10000.0)
        self.q_heads = hf["num_attention_heads"]
        self.kv_heads = hf.get("num_key_value_heads", self.q_heads)
        self.head_dim = hf.get("head_dim") or self.hidden // self.q_heads
        if self.arch == "NemotronHForCausalLM":
            names = {"M": "mamba2", "*": "attention", "-": "mlp"}
            self.kinds = [names[c] for c in hf["hybrid_override_pattern"]]
            self.m_heads = hf["mamba_num_heads"]
            self.m_head_dim = hf["mamba_head_dim"]
            self.m_groups = hf["n_groups"]
            self.d_state = hf["ssm_state_size"]
            self.d_conv = hf["conv_kernel"]
            self.mlp_inter = hf["intermediate_size"]
            self.d_inner = self.m_heads * self.m_head_dim
        elif self.arch == "Qwen3NextForCausalLM":
            names = {"linear_attention": "gdn", "full_attention": "attention"}
            self.kinds = [names[t] for t in hf["layer_types"]]
            self.k_heads = hf["linear_num_key_heads"]
            self.v_heads = hf["linear_num_value_heads"]
            self.k_dim = hf["linear_key_head_dim"]
            self.v_dim = hf["linear_value_head_dim"]
            self.d_conv = hf["linear_conv_kernel_dim"]
        else:
            raise ValueError(f"unsupported architecture {self.arch}")

    @property
    def num_layers(self):
        return len(self.kinds)

    def roles(self, layer):
        """The cache roles of a layer: kv for attention, conv and ssm for mamba2 and gdn."""
        k = self.kinds[layer]
        return ["kv"] if k == "attention" else ["conv", "ssm"] if k in ("mamba2", "gdn") else []

    def sections(self, layer, role):
        """The global sections of a layer's record: [(name, units, unit_len)], in record order
        (unit_len: elements of one unit along the unit dim)."""
        k = self.kinds[layer]
        if role == "kv":
            return [("K", self.kv_heads, 1), ("V", self.kv_heads, 1)]
        if k == "mamba2":
            if role == "conv":
                return [("x", self.m_heads, self.m_head_dim), ("B", self.m_groups, self.d_state),
                        ("C", self.m_groups, self.d_state)]
            return [("heads", self.m_heads, 1)]
        if k == "gdn":
            if role == "conv":
                return [("Q", self.k_heads, self.k_dim), ("K", self.k_heads, self.k_dim),
                        ("V", self.v_heads, self.v_dim)]
            return [("heads", self.v_heads, 1)]
        raise ValueError(f"layer {layer} ({k}) has no {role} record")

    def inner_shape(self, layer, role):
        """Sizes of a record's inner dims, in the order records.INNER names them."""
        k = self.kinds[layer]
        if role == "conv":
            return (self.d_conv - 1,)
        if k == "mamba2":
            return (self.m_head_dim, self.d_state)
        return (self.k_dim, self.v_dim)


# ---- Tensor-parallel sharding, the way engines do it ----------------------------------------

def split_heads(n, tp, rank, what):
    """Heads split evenly over the ranks (column-parallel). The engines require tp | n."""
    if n % tp:
        raise ValueError(f"tp={tp} does not divide {what}={n}")
    per = n // tp
    return list(range(rank * per, (rank + 1) * per))


def owned_by_heads(units, heads, n_heads, tp, rank, what):
    """Units (kv heads, groups, key heads) that a rank's heads use. With units >= tp each rank
    holds its even share; with fewer units than ranks, the rank holds (a replica of) the one
    unit its heads map to (vLLM's num_kv_head_replicas, Mamba2's duplicated groups)."""
    if units >= tp:
        return split_heads(units, tp, rank, what)
    per_unit = n_heads // units  # heads per unit
    mine = sorted({h // per_unit for h in heads})
    assert len(mine) == 1, f"{what}: rank {rank}'s heads {heads} span units {mine}"
    return mine


def rank_sections(cfg, layer, role, tp, rank):
    """The units a TP rank holds of each section: [(name, [global units], unit_len)], in the
    rank's local order (section order, units increasing)."""
    k = cfg.kinds[layer]
    secs = dict((n, l) for n, _, l in cfg.sections(layer, role))
    if role == "kv":
        q = split_heads(cfg.q_heads, tp, rank, "num_attention_heads")
        kv = owned_by_heads(cfg.kv_heads, q, cfg.q_heads, tp, rank, "num_key_value_heads")
        return [("K", kv, 1), ("V", kv, 1)]
    if k == "mamba2":
        heads = split_heads(cfg.m_heads, tp, rank, "mamba_num_heads")
        if role == "ssm":
            return [("heads", heads, 1)]
        groups = owned_by_heads(cfg.m_groups, heads, cfg.m_heads, tp, rank, "n_groups")
        return [("x", heads, secs["x"]), ("B", groups, secs["B"]), ("C", groups, secs["C"])]
    vh = split_heads(cfg.v_heads, tp, rank, "linear_num_value_heads")
    if role == "ssm":
        return [("heads", vh, 1)]
    kh = owned_by_heads(cfg.k_heads, vh, cfg.v_heads, tp, rank, "linear_num_key_heads")
    return [("Q", kh, secs["Q"]), ("K", kh, secs["K"]), ("V", vh, secs["V"])]


def full_rows(cfg, layer, role, local):
    """For a rank's sections (rank_sections), the index of each local unit-row in the full,
    unsharded array along the unit axis: conv channels in x|B|C (Q|K|V) order, kv heads,
    ssm heads. kv's K/V sit on an axis of their own, so kv rows are kv head ids."""
    if role == "kv":
        return np.array(local[0][1])
    offset, start = 0, {}
    for name, units, unit_len in cfg.sections(layer, role):
        start[name] = offset
        offset += units * unit_len
    rows = [start[name] + g * unit_len + c for name, units, unit_len in local
            for g in units for c in range(unit_len)]
    return np.array(rows)


# ---- Weights --------------------------------------------------------------------------------

class Model:
    """Full (unsharded) weights, drawn from `seed`."""

    def __init__(self, hf, seed=0):
        self.cfg = cfg = Config(hf)
        rng = np.random.default_rng(seed)
        H = cfg.hidden

        def dense(out, inp):
            return rng.standard_normal((out, inp)) / np.sqrt(inp)

        def norm(n):
            return 1.0 + 0.1 * rng.standard_normal(n)

        self.embed = rng.standard_normal((cfg.vocab, H))
        self.layers = []
        for kind in cfg.kinds:
            w = {"ln": norm(H)}
            if kind == "attention":
                D = cfg.head_dim
                w.update(wq=dense(cfg.q_heads * D, H), wk=dense(cfg.kv_heads * D, H),
                         wv=dense(cfg.kv_heads * D, H), wo=dense(H, cfg.q_heads * D))
            elif kind == "mlp":
                w.update(up=dense(cfg.mlp_inter, H), down=dense(H, cfg.mlp_inter))
            elif kind == "mamba2":
                di, gn, nh = cfg.d_inner, cfg.m_groups * cfg.d_state, cfg.m_heads
                conv_dim = di + 2 * gn
                # in_proj rows: z | x | B | C | dt, as NemotronH and vLLM order them.
                w.update(in_proj=dense(2 * di + 2 * gn + nh, H),
                         conv_w=rng.standard_normal((conv_dim, cfg.d_conv)) / np.sqrt(cfg.d_conv),
                         conv_b=0.1 * rng.standard_normal(conv_dim),
                         A_log=np.log(rng.uniform(1.0, 4.0, nh)),
                         D=1.0 + 0.1 * rng.standard_normal(nh),
                         dt_bias=rng.uniform(-2.0, 0.0, nh),
                         norm=norm(di), out_proj=dense(H, di))
            elif kind == "gdn":
                kd, vd = cfg.k_heads * cfg.k_dim, cfg.v_heads * cfg.v_dim
                # in_proj_qkvz rows: q | k | v | z; in_proj_ba rows: b | a.
                w.update(in_qkvz=dense(2 * kd + 2 * vd, H), in_ba=dense(2 * cfg.v_heads, H),
                         conv_w=rng.standard_normal((2 * kd + vd, cfg.d_conv))
                         / np.sqrt(cfg.d_conv),
                         A_log=np.log(rng.uniform(1.0, 4.0, cfg.v_heads)),
                         dt_bias=rng.uniform(-2.0, 0.0, cfg.v_heads),
                         norm=norm(cfg.v_dim), out_proj=dense(H, vd))
            self.layers.append(w)
        self.final_norm = norm(H)
        self.lm_head = dense(cfg.vocab, H) * 4.0

    def prompt(self, n, seed):
        return [int(t) for t in np.random.default_rng(seed).integers(0, self.cfg.vocab, n)]


def rope(x, pos, theta):
    """Rotary embedding (rotate-half) of x (..., D) at position pos."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=F64) / d)
    ang = np.asarray(pos, F64)[..., None] * inv
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _rows(blocks, width):
    """Row indices of the per-unit blocks `blocks` (unit ids) of `width` rows each."""
    return np.concatenate([np.arange(u * width, (u + 1) * width) for u in blocks]).astype(int)


class RankWeights:
    """One TP rank's slice of every layer, cut the way the engines cut it."""

    def __init__(self, model, tp, rank):
        cfg = self.cfg = model.cfg
        self.tp, self.rank = tp, rank
        self.layers = []
        for i, (kind, w) in enumerate(zip(cfg.kinds, model.layers)):
            s = {"ln": w["ln"]}
            if kind == "attention":
                D = cfg.head_dim
                q = split_heads(cfg.q_heads, tp, rank, "num_attention_heads")
                kv = rank_sections(cfg, i, "kv", tp, rank)[0][1]
                per = cfg.q_heads // cfg.kv_heads
                s.update(wq=w["wq"][_rows(q, D)], wk=w["wk"][_rows(kv, D)],
                         wv=w["wv"][_rows(kv, D)], wo=w["wo"][:, _rows(q, D)],
                         q2kv=np.array([kv.index(h // per) for h in q]), nq=len(q))
            elif kind == "mlp":
                n = cfg.mlp_inter // tp
                s.update(up=w["up"][rank * n:(rank + 1) * n],
                         down=w["down"][:, rank * n:(rank + 1) * n])
            elif kind == "mamba2":
                P, N, di, gn = cfg.m_head_dim, cfg.d_state, cfg.d_inner, cfg.m_groups * cfg.d_state
                (_, heads, _), (_, groups, _), _ = rank_sections(cfg, i, "conv", tp, rank)
                hp, gr = _rows(heads, P), _rows(groups, N)
                in_rows = np.concatenate([hp, di + hp, 2 * di + gr, 2 * di + gn + gr,
                                          2 * di + 2 * gn + np.array(heads)])
                conv_rows = full_rows(cfg, i, "conv", rank_sections(cfg, i, "conv", tp, rank))
                per = cfg.m_heads // cfg.m_groups
                s.update(in_proj=w["in_proj"][in_rows], conv_w=w["conv_w"][conv_rows],
                         conv_b=w["conv_b"][conv_rows], A_log=w["A_log"][heads],
                         D=w["D"][heads], dt_bias=w["dt_bias"][heads], norm=w["norm"][hp],
                         out_proj=w["out_proj"][:, hp], heads=np.array(heads),
                         h2g_global=np.array([h // per for h in heads]),
                         h2g=np.array([groups.index(h // per) for h in heads]),
                         nh=len(heads), ng=len(groups))
            elif kind == "gdn":
                Dk, Dv = cfg.k_dim, cfg.v_dim
                kd, vd = cfg.k_heads * Dk, cfg.v_heads * Dv
                (_, kh, _), _, (_, vh, _) = rank_sections(cfg, i, "conv", tp, rank)
                qr, vr = _rows(kh, Dk), _rows(vh, Dv)
                in_rows = np.concatenate([qr, kd + qr, 2 * kd + vr, 2 * kd + vd + vr])
                conv_rows = full_rows(cfg, i, "conv", rank_sections(cfg, i, "conv", tp, rank))
                per = cfg.v_heads // cfg.k_heads
                s.update(in_qkvz=w["in_qkvz"][in_rows],
                         in_ba=w["in_ba"][np.concatenate([vh, cfg.v_heads + np.array(vh)])],
                         conv_w=w["conv_w"][conv_rows], A_log=w["A_log"][vh],
                         dt_bias=w["dt_bias"][vh], norm=w["norm"], out_proj=w["out_proj"][:, vr],
                         v2k=np.array([kh.index(h // per) for h in vh]), nk=len(kh), nv=len(vh))
            self.layers.append(s)


# ---- The cache of one rank ------------------------------------------------------------------

class RankCache:
    """One TP rank's cache, every layer (a pp stage reads or writes only its own layers)."""

    def __init__(self, cfg, tp, rank, max_tokens):
        self.kv, self.conv, self.ssm = {}, {}, {}
        self.sections = {}  # (layer, role) -> rank_sections
        for i, kind in enumerate(cfg.kinds):
            for role in cfg.roles(i):
                local = rank_sections(cfg, i, role, tp, rank)
                self.sections[(i, role)] = local
                if role == "kv":
                    self.kv[i] = np.zeros((2, len(local[0][1]), max_tokens, cfg.head_dim),
                                          np.float32)
                elif role == "conv":
                    rows = sum(len(u) * l for _, u, l in local)
                    self.conv[i] = np.zeros((rows, cfg.d_conv - 1), np.float32)
                else:
                    self.ssm[i] = np.zeros((len(local[0][1]),) + cfg.inner_shape(i, role),
                                           np.float32)

    def array(self, layer, role):
        return {"kv": self.kv, "conv": self.conv, "ssm": self.ssm}[role][layer]


# ---- The tensor-parallel forward ------------------------------------------------------------

class TensorParallel:
    """A model run at tensor parallelism `tp`: every rank's share of every layer, the partial
    outputs summed across ranks in rank order (the all-reduce)."""

    def __init__(self, model, tp):
        self.model, self.cfg, self.tp = model, model.cfg, tp
        self.ranks = [RankWeights(model, tp, r) for r in range(tp)]

    def new_cache(self, max_tokens):
        return [RankCache(self.cfg, self.tp, r, max_tokens) for r in range(self.tp)]

    def step(self, caches, token, pos):
        """One token at position `pos` through every layer; the caches advance. Returns the
        float32 logits."""
        cfg = self.cfg
        x = r32(self.model.embed[token]).astype(F64)
        for i, kind in enumerate(cfg.kinds):
            n = rms_norm(x, self.model.layers[i]["ln"], cfg.eps)
            if kind == "attention":
                parts = [self._attention(w.layers[i], c.kv[i], n, pos)
                         for w, c in zip(self.ranks, caches)]
            elif kind == "mlp":
                parts = [w.layers[i]["down"] @ np.square(np.maximum(w.layers[i]["up"] @ n, 0))
                         for w in self.ranks]
            elif kind == "mamba2":
                parts = self._mamba2(i, caches, n)
            else:
                parts = [self._gdn(w.layers[i], c, i, n) for w, c in zip(self.ranks, caches)]
            x = r32(x + all_reduce(parts)).astype(F64)
        x = rms_norm(x, self.model.final_norm, cfg.eps)
        return r32(self.model.lm_head @ x)

    def prefill(self, caches, tokens, start=0):
        """Runs tokens[start:] at positions start..; returns the logits of each."""
        return [self.step(caches, t, start + j) for j, t in enumerate(tokens[start:])]

    def decode(self, caches, first, pos, n):
        """Greedy decoding: feeds `first` at `pos`, then each argmax; n steps. Returns the
        tokens fed ([first, ...], n of them) and the logits of each step."""
        tokens, logits, t = [], [], first
        for j in range(n):
            tokens.append(t)
            lg = self.step(caches, t, pos + j)
            logits.append(lg)
            t = int(np.argmax(lg))
        tokens.append(t)
        return tokens, np.array(logits)

    # -- layers (one rank, or all ranks where a layer reduces mid-way) --

    def _attention(self, w, kv, n, pos):
        cfg = self.cfg
        D = cfg.head_dim
        q = rope((w["wq"] @ n).reshape(-1, D), pos, cfg.rope_theta)
        k = rope((w["wk"] @ n).reshape(-1, D), pos, cfg.rope_theta)
        kv[0, :, pos] = r32(k)
        kv[1, :, pos] = r32(w["wv"] @ n).reshape(-1, D)
        K = kv[0, :, :pos + 1].astype(F64)[w["q2kv"]]
        V = kv[1, :, :pos + 1].astype(F64)[w["q2kv"]]
        s = np.einsum("htd,hd->ht", K, q) / np.sqrt(D)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        return w["wo"] @ np.einsum("ht,htd->hd", p, V).reshape(-1)

    @staticmethod
    def _conv(conv, new, weight, bias=None):
        """Causal depthwise conv1d over the kept window and the new input; updates `conv`
        (rows: channels) in place and returns silu(conv output)."""
        window = np.concatenate([conv.astype(F64), r32(new).astype(F64)[:, None]], axis=1)
        conv[:] = r32(window[:, 1:])
        out = (window * weight).sum(axis=1)
        return silu(out if bias is None else out + bias)

    def _mamba2(self, i, caches, n):
        cfg = self.cfg
        P, N = cfg.m_head_dim, cfg.d_state
        ys, sumsq = [], np.zeros((self.tp, cfg.m_groups))
        for r, (w, c) in enumerate(zip(self.ranks, caches)):
            w = w.layers[i]
            nh, ng = w["nh"], w["ng"]
            proj = w["in_proj"] @ n
            z, xbc, dt = proj[:nh * P], proj[nh * P:-nh], proj[-nh:]
            act = self._conv(c.conv[i], xbc, w["conv_w"], w["conv_b"])
            xs = act[:nh * P].reshape(nh, P)
            B = act[nh * P:nh * P + ng * N].reshape(ng, N)[w["h2g"]]
            C = act[nh * P + ng * N:].reshape(ng, N)[w["h2g"]]
            dt = softplus(dt + w["dt_bias"])
            A = -np.exp(w["A_log"])
            h = c.ssm[i].astype(F64) * np.exp(dt * A)[:, None, None] \
                + dt[:, None, None] * xs[:, :, None] * B[:, None, :]
            c.ssm[i][:] = r32(h)
            y = np.einsum("hpn,hn->hp", c.ssm[i].astype(F64), C) + w["D"][:, None] * xs
            y = y * silu(z.reshape(nh, P))
            np.add.at(sumsq[r], w["h2g_global"], (y * y).sum(axis=1))
            ys.append(y)
        # Gated RMS norm per group: a group spread over ranks all-reduces its sum of squares.
        total = all_reduce(list(sumsq))
        group_size = cfg.d_inner // cfg.m_groups
        parts = []
        for w, y in zip(self.ranks, ys):
            w = w.layers[i]
            var = total[w["h2g_global"]] / group_size
            yn = (y / np.sqrt(var + cfg.eps)[:, None]).reshape(-1) * w["norm"]
            parts.append(w["out_proj"] @ yn)
        return parts

    def _gdn(self, w, c, i, n):
        cfg = self.cfg
        Dk, Dv = cfg.k_dim, cfg.v_dim
        nk, nv = w["nk"], w["nv"]
        proj = w["in_qkvz"] @ n
        qkv, z = proj[:2 * nk * Dk + nv * Dv], proj[2 * nk * Dk + nv * Dv:]
        b, a = np.split(w["in_ba"] @ n, 2)
        act = self._conv(c.conv[i], qkv, w["conv_w"])
        q = act[:nk * Dk].reshape(nk, Dk)
        k = act[nk * Dk:2 * nk * Dk].reshape(nk, Dk)
        v = act[2 * nk * Dk:].reshape(nv, Dv)
        q = q / np.sqrt((q * q).sum(axis=1, keepdims=True) + 1e-6) / np.sqrt(Dk)
        k = k / np.sqrt((k * k).sum(axis=1, keepdims=True) + 1e-6)
        q, k = q[w["v2k"]], k[w["v2k"]]
        beta = sigmoid(b)
        g = -np.exp(w["A_log"]) * softplus(a + w["dt_bias"])
        S = c.ssm[i].astype(F64) * np.exp(g)[:, None, None]
        delta = (v - np.einsum("hkv,hk->hv", S, k)) * beta[:, None]
        c.ssm[i][:] = r32(S + k[:, :, None] * delta[:, None, :])
        o = np.einsum("hkv,hk->hv", c.ssm[i].astype(F64), q)
        o = rms_norm(o, w["norm"], cfg.eps) * silu(z.reshape(nv, Dv))
        return w["out_proj"] @ o.reshape(-1)


def all_reduce(parts):
    """The sum of the ranks' partial outputs, in rank order."""
    total = np.array(parts[0], F64)
    for p in parts[1:]:
        total = total + p
    return total


# ---- Moving a cache between TP layouts, logically (the ideal mover) --------------------------

def gather_full(cfg, caches, tp, layer, role):
    """The unsharded array of one (layer, role) from a TP instance's rank caches. Replicated
    units must hold the same bits on every rank that holds them (checked)."""
    first = caches[0].array(layer, role)
    axis = 1 if role == "kv" else 0
    units = cfg.kv_heads if role == "kv" else sum(u * l for _, u, l in cfg.sections(layer, role))
    shape = list(first.shape)
    shape[axis] = units
    full = np.full(shape, np.nan, np.float32)
    seen = np.zeros(units, bool)
    for r, c in enumerate(caches):
        rows = full_rows(cfg, layer, role, c.sections[(layer, role)])
        local = c.array(layer, role)
        for j, row in enumerate(rows):
            piece = np.take(local, j, axis=axis)
            if seen[row]:
                assert np.array_equal(np.take(full, row, axis=axis).view(np.uint32),
                                      piece.view(np.uint32)), (
                    f"layer {layer} {role}: replicas of unit-row {row} differ at rank {r}")
            else:
                if axis == 0:
                    full[row] = piece
                else:
                    full[:, row] = piece
                seen[row] = True
    assert seen.all(), f"layer {layer} {role}: rows {np.flatnonzero(~seen)} held by no rank"
    return full


def reshard(cfg, caches, tp_to, max_tokens):
    """The caches of a TP instance re-cut for `tp_to` ranks by the model's own sharding: what
    a correct mover must produce."""
    tp_from = len(caches)
    out = [RankCache(cfg, tp_to, r, max_tokens) for r in range(tp_to)]
    for i in range(cfg.num_layers):
        for role in cfg.roles(i):
            full = gather_full(cfg, caches, tp_from, i, role)
            for c in out:
                rows = full_rows(cfg, i, role, c.sections[(i, role)])
                dst = c.array(i, role)
                if role == "kv":
                    n = min(full.shape[2], dst.shape[2])
                    dst[:, :, :n] = full[:, rows, :n]
                else:
                    dst[:] = full[rows]
    return out


# ---- The reference: the whole sequence at once, unsharded -----------------------------------

def forward_sequence(model, tokens):
    """Logits (len(tokens), vocab) of every position, computed over the whole sequence in
    float64 without a cache: causal-masked attention, the conv as a full causal convolution,
    Mamba2 in its quadratic (SSD) form, the delta rule as a loop. A formulation independent of
    the step used by TensorParallel, to check the cache-carrying step against."""
    cfg = model.cfg
    L = len(tokens)
    pos = np.arange(L)
    x = model.embed[np.array(tokens)]
    causal = np.tril(np.ones((L, L), bool))
    for w, kind in zip(model.layers, cfg.kinds):
        n = rms_norm(x, w["ln"], cfg.eps)
        if kind == "attention":
            D = cfg.head_dim
            q = rope((n @ w["wq"].T).reshape(L, -1, D).transpose(1, 0, 2), pos, cfg.rope_theta)
            k = rope((n @ w["wk"].T).reshape(L, -1, D).transpose(1, 0, 2), pos, cfg.rope_theta)
            v = (n @ w["wv"].T).reshape(L, -1, D).transpose(1, 0, 2)
            rep = cfg.q_heads // cfg.kv_heads
            k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
            s = np.where(causal, q @ k.transpose(0, 2, 1) / np.sqrt(D), -np.inf)
            p = np.exp(s - s.max(axis=2, keepdims=True))
            p /= p.sum(axis=2, keepdims=True)
            out = (p @ v).transpose(1, 0, 2).reshape(L, -1) @ w["wo"].T
        elif kind == "mlp":
            out = np.square(np.maximum(n @ w["up"].T, 0)) @ w["down"].T
        elif kind == "mamba2":
            P, N, G, Hm = cfg.m_head_dim, cfg.d_state, cfg.m_groups, cfg.m_heads
            di, gn = cfg.d_inner, G * N
            proj = n @ w["in_proj"].T
            z, xbc, dt = proj[:, :di], proj[:, di:2 * di + 2 * gn], proj[:, 2 * di + 2 * gn:]
            act = silu(causal_conv(xbc, w["conv_w"]) + w["conv_b"])
            xs = act[:, :di].reshape(L, Hm, P)
            B = act[:, di:di + gn].reshape(L, G, N)
            C = act[:, di + gn:].reshape(L, G, N)
            dt = softplus(dt + w["dt_bias"])
            cum = np.cumsum(dt * -np.exp(w["A_log"]), axis=0)  # (L, H)
            y = np.empty((L, Hm, P))
            for h in range(Hm):
                g = h // (Hm // G)
                decay = np.exp(np.where(causal, cum[:, None, h] - cum[None, :, h], -np.inf))
                M = (C[:, g] @ B[:, g].T) * decay * dt[None, :, h]
                y[:, h] = M @ xs[:, h] + w["D"][h] * xs[:, h]
            y = (y.reshape(L, di) * silu(z)).reshape(L, G, di // G)
            y = y / np.sqrt(np.mean(y * y, axis=2, keepdims=True) + cfg.eps)
            out = (y.reshape(L, di) * w["norm"]) @ w["out_proj"].T
        else:
            Hk, Hv, Dk, Dv = cfg.k_heads, cfg.v_heads, cfg.k_dim, cfg.v_dim
            kd, vd = Hk * Dk, Hv * Dv
            proj = n @ w["in_qkvz"].T
            act = silu(causal_conv(proj[:, :2 * kd + vd], w["conv_w"]))
            z = proj[:, 2 * kd + vd:].reshape(L, Hv, Dv)
            ba = n @ w["in_ba"].T
            beta, a = sigmoid(ba[:, :Hv]), ba[:, Hv:]
            gate = np.exp(-np.exp(w["A_log"]) * softplus(a + w["dt_bias"]))
            rep = Hv // Hk
            q = np.repeat(act[:, :kd].reshape(L, Hk, Dk), rep, axis=1)
            k = np.repeat(act[:, kd:2 * kd].reshape(L, Hk, Dk), rep, axis=1)
            v = act[:, 2 * kd:].reshape(L, Hv, Dv)
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(Dk)
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
            S = np.zeros((Hv, Dk, Dv))
            o = np.empty((L, Hv, Dv))
            for t in range(L):
                S = S * gate[t][:, None, None]
                u = (v[t] - np.einsum("hkv,hk->hv", S, k[t])) * beta[t][:, None]
                S = S + k[t][:, :, None] * u[:, None, :]
                o[t] = np.einsum("hkv,hk->hv", S, q[t])
            o = rms_norm(o, w["norm"], cfg.eps) * silu(z)
            out = o.reshape(L, vd) @ w["out_proj"].T
        x = x + out
    return rms_norm(x, model.final_norm, cfg.eps) @ model.lm_head.T


def causal_conv(seq, weight):
    """Depthwise causal conv1d of seq (L, C) with weight (C, k), zero history."""
    k = weight.shape[1]
    pad = np.concatenate([np.zeros((k - 1, seq.shape[1])), seq])
    return sum(pad[j:j + len(seq)] * weight[:, j] for j in range(k))
