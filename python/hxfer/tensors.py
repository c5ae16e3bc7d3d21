"""Records from an engine's tensors, for hxfer.Layout.from_records.

An engine hands its connector tensors: a pool (one backing buffer, or one per layer) and, per
layer, a view of it whose first dim indexes blocks (attention) or state ids (Mamba). What each
further dim means is the engine's to say; its sizes and strides are read off the tensor, so no
engine version is written down here. A dim may hold two logical dims (vLLM keeps K and V side by
side in its last dim: ("kv", 2), ("dim", head_size)), and a dim of size 1 may be left unnamed.

    pools = {"kv": buf.numel() * buf.element_size()}
    records = [tensor_record(3, "kv", kv_cache["layers.3.attn"], "kv", buf.data_ptr(),
                             ["head", "token", [("kv", 2), ("dim", 128)]])]
    layout = hxfer.Layout.from_records(model=..., pools=pools, records=records, ...)

Works with torch tensors and numpy arrays (anything with shape, strides and a data pointer).
"""

from math import prod

__all__ = ["tensor_record", "contiguous_record", "tensor_geometry"]


def tensor_geometry(t):
    """(data pointer, shape, strides in bytes, element size) of a torch tensor or numpy array."""
    if hasattr(t, "data_ptr") and hasattr(t, "element_size"):  # torch
        itemsize = t.element_size()
        return t.data_ptr(), tuple(t.shape), tuple(s * itemsize for s in t.stride()), itemsize
    if hasattr(t, "__array_interface__"):  # numpy and friends: strides are in bytes already
        ai = t.__array_interface__
        itemsize = t.itemsize
        strides = ai.get("strides")
        if strides is None:  # C-contiguous
            strides, step = [], itemsize
            for n in reversed(t.shape):
                strides.insert(0, step)
                step *= n
        return ai["data"][0], tuple(t.shape), tuple(strides), itemsize
    raise TypeError(f"expected a torch tensor or a numpy array, got {type(t).__name__}")


def _dims(names, shape, strides, where):
    if len(names) != len(shape):
        raise ValueError(f"{where}: {len(names)} dim names for {len(shape)} dims {list(shape)}")
    out = []
    for name, size, stride in zip(names, shape, strides):
        if name is None:
            if size != 1:
                raise ValueError(f"{where}: an unnamed dim must have size 1, this one has {size}")
            continue
        if isinstance(name, str):
            out.append((name, size, stride))
            continue
        parts = list(name)  # [(name, size), ...], outermost first
        if prod(n for _, n in parts) != size:
            raise ValueError(f"{where}: the parts {parts} of a dim of size {size} do not multiply"
                             f" to it")
        step = stride
        split = []
        for part, n in reversed(parts):
            split.insert(0, (part, n, step))
            step *= n
        out.extend(split)
    return out


def tensor_record(layer, role, view, pool, pool_ptr, names, *, state_group=0, section=None):
    """The record dict of global `layer`'s `role` ("kv", "conv", "ssm") that `view` holds: dim 0
    of the view indexes blocks (kv) or state ids (conv/ssm); `names` says what each further dim
    is (a logical name, a list of (name, size) parts outermost first, or None for a dim of size
    1). `pool_ptr` is the data pointer of `pool`'s buffer. `section` is "K" or "V" for a kv view
    holding one of them; `state_group` which of a request's state ids indexes a state view."""
    ptr, shape, strides, _ = tensor_geometry(view)
    where = f"layer {layer} {role}"
    if ptr < pool_ptr:
        raise ValueError(f"{where}: the view starts {pool_ptr - ptr} bytes before its pool")
    return {"layer": layer, "role": role, "pool": pool, "offset": ptr - pool_ptr,
            "index_stride": strides[0], "state_group": state_group, "section": section,
            "dims": _dims(list(names), shape[1:], strides[1:], where)}


def contiguous_record(layer, role, pool, offset, index_stride, shape, names, itemsize, *,
                      state_group=0, section=None):
    """The record dict of a row-major tensor of `shape` (without the index dim) and element size
    `itemsize` that starts `offset` bytes into `pool`, records `index_stride` bytes apart: a
    state inside a page (vLLM's Mamba page holds conv then ssm, each row-major)."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return {"layer": layer, "role": role, "pool": pool, "offset": offset,
            "index_stride": index_stride, "state_group": state_group, "section": section,
            "dims": _dims(list(names), tuple(shape), tuple(strides), f"layer {layer} {role}")}
