"""A rank's cache (hybrid.RankCache) in and out of an engine layout's pools, element by element,
through hxfer.Layout.records(layer, role) alone.

The record of index i (a block for kv, a slot for conv and ssm) starts at pool byte
`offset + i * index_stride`; local unit u of a section at `+ base + u * unit_stride`, its
element c along the unit dim at `+ c * within_stride`, and the inner dims (kv: token, dim;
conv: window; mamba2 ssm: head_dim, state; gdn ssm: key, value) add index x stride. The
section's global unit is first_unit + u; the model says which row of its rank-local array
holds (section, global unit, c), so the mapping from hxfer's description to the model's
arrays goes through global units only, and every disagreement between the two about what a
rank holds is an error naming layout, layer, role and section (LayoutMismatch).
"""

import numpy as np

UNIT_DIMS = {"kv", "head", "channel"}  # the section and unit dims; every other dim is inner


class LayoutMismatch(AssertionError):
    """hxfer's records disagree with what the model's TP rank holds."""


def field(obj, name):
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


def inner_dims(cfg, layer, role):
    if role == "kv":
        return ("token", "dim")
    if role == "conv":
        return ("window",)
    return ("head_dim", "state") if cfg.kinds[layer] == "mamba2" else ("key", "value")


def as_bytes(buf):
    return np.asarray(buf).reshape(-1).view(np.uint8)


def section_offsets(part, sec, inner, inner_shape):
    """Byte offsets inside one record of every element of a section: shape
    (units, unit_len, *inner sizes)."""
    dims = {field(d, "name"): d for d in field(part, "dims")}
    unknown = set(dims) - UNIT_DIMS - set(inner)
    missing = set(inner) - set(dims)
    if unknown or missing:
        raise LayoutMismatch(f"record of pool {field(part, 'pool')}: dims {sorted(dims)}, "
                             f"expected {sorted(inner)} inside")
    units, ulen = field(sec, "units"), field(sec, "unit_len")
    off = (field(sec, "base") + np.arange(units, dtype=np.int64)[:, None] * field(sec, "unit_stride")
           + np.arange(ulen, dtype=np.int64)[None, :] * field(sec, "within_stride"))
    off = off.reshape((units, ulen) + (1,) * len(inner))
    for j, name in enumerate(inner):
        d = dims[name]
        if field(d, "size") != inner_shape[j]:
            raise LayoutMismatch(f"record dim {name} has size {field(d, 'size')}, the model "
                                 f"{inner_shape[j]}")
        shape = [1] * (2 + len(inner))
        shape[2 + j] = inner_shape[j]
        off = off + (np.arange(inner_shape[j], dtype=np.int64) * field(d, "stride")).reshape(shape)
    return off


def load(mem, offsets):
    idx = offsets[..., None] + np.arange(4)
    return np.ascontiguousarray(mem[idx]).view("<f4")[..., 0]


def store(mem, offsets, values):
    vals = np.ascontiguousarray(np.asarray(values, "<f4")[..., None]).view(np.uint8)
    mem[offsets[..., None] + np.arange(4)] = vals


class RankPages:
    """One rank's pools in an engine layout (hxfer.Layout) and its cache in them."""

    def __init__(self, layout, cfg, buffers):
        self.layout, self.cfg = layout, cfg
        self.buffers = buffers
        self.mem = {name: as_bytes(b) for name, b in buffers.items()}
        self.T = layout.tokens_per_block
        self.layers = list(layout.layers())

    def describe(self):
        return self.layout.describe()

    def _where(self, cache, layer, role):
        """For each part and section of the record: (part, sec, rows) where rows says, per
        (local unit u, element c), the row of the rank's array (conv: channel; kv: head; ssm:
        head). Checks that hxfer's units are exactly the model rank's."""
        mine = {}
        row = 0
        for name, units, ulen in cache.sections[(layer, role)]:
            mine[name] = (units, ulen, row)
            row += len(units) * ulen if role == "conv" else 0
        seen = {name: [] for name in mine}
        out = []
        for part in self.layout.records(layer, role):
            if field(part, "dtype") != "fp32" or field(part, "element_bytes") != 4:
                raise LayoutMismatch(f"{self.describe()} layer {layer} {role}: dtype "
                                     f"{field(part, 'dtype')}, the proof needs fp32")
            for sec in field(part, "sections"):
                name = field(sec, "name")
                where = f"{self.describe()} layer {layer} {role} section {name}"
                if name not in mine:
                    raise LayoutMismatch(f"{where}: the model has no such section "
                                         f"(it has {sorted(mine)})")
                units, ulen, start = mine[name]
                if field(sec, "unit_len") != ulen:
                    raise LayoutMismatch(f"{where}: unit_len {field(sec, 'unit_len')}, the "
                                         f"model's unit is {ulen} elements")
                first = field(sec, "first_unit")
                glob = list(range(first, first + field(sec, "units")))
                if not set(glob) <= set(units):
                    raise LayoutMismatch(f"{where}: hxfer places global units {glob} on this "
                                         f"rank, the engine's rank holds {units}")
                seen[name] += glob
                local = np.array([units.index(g) for g in glob], np.int64)
                if role == "conv":
                    rows = start + local[:, None] * ulen + np.arange(ulen)[None, :]
                else:
                    rows = local[:, None]
                out.append((part, sec, rows))
        for name, (units, _, _) in mine.items():
            if sorted(seen[name]) != list(units):
                raise LayoutMismatch(f"{self.describe()} layer {layer} {role} section {name}: "
                                     f"hxfer describes units {sorted(seen[name])}, the engine's "
                                     f"rank holds {units}")
        return out

    def _kv_offsets(self, part, sec, blocks, t0, t1):
        """Offsets (J, units, 1, T, D) of the blocks covering tokens [t0, t1), the token grid
        (J, T) and the blocks' ids."""
        T = self.T
        j = np.arange(t0 // T, -(-t1 // T))
        tok = j[:, None] * T + np.arange(T)[None, :]
        idx = np.asarray(blocks, np.int64)[j]
        rec = field(part, "offset") + idx * field(part, "index_stride")
        off = section_offsets(part, sec, ("token", "dim"), (T, self.cfg.head_dim))
        return rec[:, None, None, None, None] + off[None], tok

    def write(self, cache, blocks, slot, tokens, roles=("kv", "conv", "ssm")):
        """Writes the rank's cache of the layers this layout holds: kv of tokens
        [tokens[0], tokens[1]) into `blocks` (the request's block table), conv and ssm into
        `slot`. Returns the bytes written; no byte is written twice (checked)."""
        return self._io(cache, blocks, slot, tokens, roles, write=True)

    def read(self, cache, blocks, slot, tokens, roles=("kv", "conv", "ssm")):
        """The inverse of write: fills the cache's arrays from the pools."""
        return self._io(cache, blocks, slot, tokens, roles, write=False)

    def _io(self, cache, blocks, slot, tokens, roles, write):
        t0, t1 = tokens
        touched = {name: np.zeros(len(m), np.uint8) for name, m in self.mem.items()}
        for layer in self.layers:
            for role in self.cfg.roles(layer):
                if role not in roles:
                    continue
                arr = cache.array(layer, role)
                for part, sec, rows in self._where(cache, layer, role):
                    mem = self.mem[field(part, "pool")]
                    if role == "kv":
                        off, tok = self._kv_offsets(part, sec, blocks, t0, t1)
                        kvi = 0 if field(sec, "name") == "K" else 1
                        keep = (tok >= t0) & (tok < t1)  # (J, T)
                        off = off.transpose(0, 3, 1, 2, 4)[keep]  # (n, units, 1, D)
                        heads = rows[:, 0]
                        toks = tok[keep]
                        if write:
                            vals = arr[kvi][heads][:, toks].transpose(1, 0, 2)[:, :, None, :]
                            store(mem, off, vals)
                        else:
                            got = load(mem, off)[:, :, 0, :]  # (n, units, D)
                            for u, h in enumerate(heads):
                                arr[kvi, h, toks] = got[:, u]
                    else:
                        rec = field(part, "offset") + slot * field(part, "index_stride")
                        inner = inner_dims(self.cfg, layer, role)
                        shape = self.cfg.inner_shape(layer, role)
                        off = rec + section_offsets(part, sec, inner, shape)
                        if write:
                            store(mem, off, arr[rows])
                        else:
                            arr[rows] = load(mem, off)
                    if write:
                        t = touched[field(part, "pool")]
                        np.add.at(t, (off[..., None] + np.arange(4)).reshape(-1), 1)
        total = 0
        for name, t in touched.items():
            if (t > 1).any():
                raise LayoutMismatch(f"{self.describe()}: {int((t > 1).sum())} bytes of pool "
                                     f"{name} belong to two elements")
            total += int(t.sum())
        return total
