"""Where a request's pages lie in an engine's pools, from Layout.pools() alone.

A pool is described as rows of its outermost index (shape[0] rows of strides[0] bytes, then
the inner index, if any, down to a record's pitch): blocks for kv pools, slots for paged state
pools, layers for layer-major state pools (each layer row then holds every slot's record,
slot-major). With capacities that differ from each other and from the layer counts, the row
count says which one a pool is.

The byte checks built on this (`expect_arrived`) need no knowledge of the engine's element
order: the source pages hold a random pattern P, the destination pages start as ~P (every byte
differs), and after a transfer every destination byte must be P (it arrived, in the right
place) or ~P (hxfer never wrote it: padding, the rest of a partial block), with exactly as many
P bytes as hxfer says it moved. A byte landing in the wrong place is neither (but for a 2/256
chance per byte), and a byte missing leaves the P count short.
"""

import numpy as np


def as_bytes(buf):
    """A writable flat uint8 numpy view of a pool buffer (numpy, bytearray, memoryview,
    hxfer.SharedBuffer or a CPU torch tensor)."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    if hasattr(buf, "data_ptr") and hasattr(buf, "numpy"):  # torch
        return buf.numpy().reshape(-1).view(np.uint8)
    return np.frombuffer(buf, np.uint8)


def numpy_pools(layout):
    return {p["name"]: np.zeros(p["bytes"], np.uint8) for p in layout.pools()}


def record_spans(layout, pool, blocks, slot):
    """(offset, length) of every record of the request's pages in `pool`, in a fixed order."""
    shape, strides = pool["shape"], pool["strides"]
    rows, pitch = (shape[0], strides[0]) if len(shape) >= 2 else (1, pool["bytes"])
    if layout.num_blocks == layout.num_slots:
        raise ValueError("give the layout different block and slot counts: rows are told "
                         "apart by their count")
    if rows == layout.num_blocks:
        return [(b * pitch, pitch) for b in blocks]
    if slot is None:
        return []
    if rows == layout.num_slots:
        return [(slot * pitch, pitch)]
    # Layer-major: each layer row holds the records of every slot.
    if pitch % layout.num_slots != 0:
        raise AssertionError(f"pool {pool['name']}: {rows} rows of {pitch} bytes are neither "
                             f"{layout.num_blocks} blocks, {layout.num_slots} slots nor layers")
    record = pitch // layout.num_slots
    return [(row * pitch + slot * record, record) for row in range(rows)]


def request_span_bytes(layout, blocks, slot):
    return sum(n for p in layout.pools() for _, n in record_spans(layout, p, blocks, slot))


def gather(layout, buffers, blocks, slot):
    """The bytes of the request's records, concatenated in record_spans order."""
    parts = []
    for p in layout.pools():
        mem = as_bytes(buffers[p["name"]])
        parts += [mem[o:o + n] for o, n in record_spans(layout, p, blocks, slot)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def scatter(layout, buffers, blocks, slot, data):
    """Writes `data` (as gather returns it) into the request's records."""
    at = 0
    for p in layout.pools():
        mem = as_bytes(buffers[p["name"]])
        for o, n in record_spans(layout, p, blocks, slot):
            mem[o:o + n] = data[at:at + n]
            at += n
    assert at == len(data), (at, len(data))


def pattern(n, *key):
    """n deterministic pseudo-random bytes for `key` (e.g. seed, request id, rank)."""
    return np.frombuffer(np.random.default_rng(list(key)).bytes(n), np.uint8)


def fill(layout, buffers, blocks, slot, *key):
    """Fills the request's records with pattern(key); returns the pattern."""
    data = pattern(request_span_bytes(layout, blocks, slot), *key)
    scatter(layout, buffers, blocks, slot, data)
    return data


def expect_arrived(got, sent, moved_bytes, what="pages"):
    """Checks destination bytes `got` (pre-filled with ~sent) against `sent`: every byte is
    either sent (arrived) or ~sent (never written), and moved_bytes of them arrived. Returns
    the number of bytes that arrived."""
    assert got.shape == sent.shape, (what, got.shape, sent.shape)
    arrived = got == sent
    untouched = got == ~sent
    wrong = np.flatnonzero(~(arrived | untouched))
    assert wrong.size == 0, (f"{what}: {wrong.size} bytes hold neither the sent byte nor the "
                             f"initial one, first at {wrong[:8].tolist()}")
    n = int(arrived.sum())
    assert n == moved_bytes, f"{what}: {n} bytes arrived where hxfer reports {moved_bytes}"
    return n


# ---- The small engines the tests play ----

MODEL = "tiny-hybrid"  # 2 attention and 4 Mamba-2 layers: a few KiB a request
NUM_BLOCKS = 16
NUM_SLOTS = 6  # neither the block count nor a layer count: pools() rows tell them apart


def tiny_layout(engine="trtllm-v2", tp=1, tp_rank=0, **options):
    import hxfer

    options.setdefault("num_blocks", NUM_BLOCKS)
    options.setdefault("num_slots", NUM_SLOTS)
    # One dtype per role on every engine, so that different engines pair up (their own
    # defaults differ: trtllm keeps ssm state in the model dtype, bf16 here).
    options.setdefault("conv_dtype", "bf16")
    options.setdefault("ssm_dtype", "fp32")
    return hxfer.Layout.engine(engine, model=MODEL, tp=tp, tp_rank=tp_rank, **options)


class Released:
    """An on_released callback that remembers the ids, for waiting on them."""

    def __init__(self):
        import threading

        self.ids = []
        self._cv = threading.Condition()

    def __call__(self, request_id):
        with self._cv:
            self.ids.append(request_id)
            self._cv.notify_all()

    def wait_for(self, request_id, timeout=10.0):
        with self._cv:
            return self._cv.wait_for(lambda: request_id in self.ids, timeout)

    def count(self, request_id):
        with self._cv:
            return self.ids.count(request_id)


def wait_until(predicate, timeout=10.0, step=0.005):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True
