#!/usr/bin/env python3
"""Checks hxfer's named layouts against the serving engines' released code, executed.

For every preset model and tp 1/2/4 this runs the engines' own functions (vLLM 0.32's config
hooks, MambaStateShapeCalculator / MambaStateDtypeCalculator through the model classes,
Attention / MambaBase.get_kv_cache_spec, customize_attention_spec, Platform.
_align_hybrid_block_size, get_kv_cache_groups, resolve_kv_cache_layout,
get_kv_cache_config_from_groups, allocate_kv_cache, MambaBase.bind_kv_cache and the attention
backends' K/V split; SGLang 0.5.23's config classes' mamba2_cache_params, MambaPool,
MHATokenToKVPool and its slot and page allocators), allocating on torch's meta device (no
memory). From the views the engine hands its kernels it reads every record's address function
(region, offset, index stride, dtype, named dims with sizes and byte strides) and compares it,
rank by rank, with hxfer.Layout.engine(...).records(). Only what a dim means is written here
(that the engine's conv shape (k-1, C) is (window, channel), that FlashAttention's K view is
(block, token, head, dim), ...), each next to the engine code it names; sizes, strides, offsets,
block sizes, dtypes, groups and reserved ids all come from the engine.

vLLM's CPU backend (variants `vllm-cpu`, ISA vec as on a CPU without AMX tiles, and `vllm-cpu
amx`) hands its kernel a (head, token, dim) view whose strides are not where the kernel writes:
there the check runs the installed kernel (`ops.cpu_attn_reshape_and_cache`, the ISA vLLM's
`_get_attn_isa` picks) on a real 2-block cache of the layer's block shape and vLLM's block size,
and compares the byte offset of every K and V element (head, token, dim) with the one hxfer's
record dims give (split dims mixed radix, the first named most significant). The CPU platform's
block size and ssm dtype rules (`CpuPlatform.check_and_update_config`) are executed from its
source first, so on a CPU with AVX512-BF16 the ssm state is fp32 and hxfer is told
`ssm_dtype="fp32"`, as a CPU user must.

Exit status: 0 when every row passes (or is skipped with the engine's reason), 1 on any FAIL,
2 when the engines cannot be imported. Run through tests/engines/run.sh.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import logging
import os
import sys
import textwrap
import time
import traceback
import warnings
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESETS_DIR = os.path.join(ROOT, "presets")
TPS = (1, 2, 4)
NUM_BLOCKS = 4  # blocks the engines are sized for (meta tensors: the count only scales bytes)
SGLANG_PAGE_SIZE = 16  # --page-size; SGLang's pools take any page size
SGLANG_SLOTS = 3  # MambaPool size (requests); the pool holds size + 1 slots

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32",
               "torch.float8_e4m3fn": "fp8", "torch.int8": "int8", "torch.uint8": "uint8"}


def dtype_name(dt) -> str:
    return DTYPE_NAMES.get(str(dt), str(dt))


# ---------------------------------------------------------------------------------------------
# The common description: a record as an address function inside a region.


@dataclasses.dataclass
class Part:
    region: str  # engine: a buffer the engine registers; hxfer: a pool name
    offset: int  # bytes from the region's start to element 0 of index 0
    index_stride: int  # bytes between consecutive block / slot ids
    dtype: str
    dims: list  # [(name, size, stride in bytes)], as listed (hxfer) or as the view's axes
    what: str = ""  # "K", "V" or "" (the whole record)
    state_group: int | None = None
    # Engine only, where the dims of the view the engine hands its kernel are not where the
    # kernel puts the elements (vLLM's CPU attention): the byte offset of every element
    # (head, token, dim) from `offset`, measured by running the kernel (a (H, T, D) tensor).
    elements: object = None

    def order(self) -> list:
        """Dim names outermost first, by stride; size-1 dims have no place."""
        return [n for n, s, st in sorted(self.dims, key=lambda d: -d[2]) if s > 1]

    def split_kv(self) -> list:
        """K and V as parts of their own, where one part holds both along a `kv` dim."""
        kv = [d for d in self.dims if d[0] == "kv"]
        if not kv:
            return [self]
        rest = [d for d in self.dims if d[0] != "kv"]
        return [dataclasses.replace(self, offset=self.offset + i * kv[0][2], dims=rest, what=w)
                for i, w in enumerate(("K", "V"))]

    def text(self) -> str:
        dims = ",".join(f"{n}{s}@{st}" for n, s, st in self.dims)
        return f"{self.region}+{self.offset} idx@{self.index_stride} {self.dtype} [{dims}]"


@dataclasses.dataclass
class Rank:
    """One rank's cache as an engine lays it out, or as hxfer describes it."""
    parts: dict  # (layer, role) -> [Part]
    regions: dict  # name -> bytes
    tokens_per_block: int | None = None
    reserved: dict = dataclasses.field(default_factory=dict)  # "block"/"slot" -> sorted ids
    dtypes: dict = dataclasses.field(default_factory=dict)  # hxfer option -> the engine's dtype
    notes: list = dataclasses.field(default_factory=list)


def from_tensor(t, labels, region, base, what="", state_group=None) -> Part:
    """A Part for the torch view `t` whose axis 0 is the block / slot id and whose other axes are
    named `labels`; `base` is the byte offset of `region` inside t's storage."""
    es = t.element_size()
    assert len(labels) == t.dim() - 1, (labels, tuple(t.shape))
    dims = [(n, int(s), int(st) * es) for n, s, st in zip(labels, t.shape[1:], t.stride()[1:])]
    return Part(region=region, offset=t.storage_offset() * es - base,
                index_stride=int(t.stride(0)) * es, dtype=dtype_name(t.dtype), dims=dims,
                what=what, state_group=state_group)


def merge_kv(k: Part, v: Part) -> Part:
    """K and V views of one tensor (same dims, V a fixed distance after K) as one record."""
    same = (k.region == v.region and k.dims == v.dims and k.index_stride == v.index_stride)
    if not same or v.offset <= k.offset:
        raise AssertionError(f"K {k.text()} and V {v.text()} are not one tensor")
    return dataclasses.replace(k, dims=[("kv", 2, v.offset - k.offset)] + k.dims, what="")


# ---------------------------------------------------------------------------------------------
# hxfer


def hxfer_reserved(layout, kind: str):
    """The ids hxfer's layout says the engine never hands to a request ('block' or 'slot'), or
    None when the layout does not say. The contract this check reads: a Layout attribute
    `reserved_blocks` / `reserved_slots` (a sequence of ids) or a method `reserved(kind)`."""
    attr = getattr(layout, f"reserved_{kind}s", None)
    if attr is None and callable(getattr(layout, "reserved", None)):
        attr = layout.reserved(kind)
    if attr is None:
        return None
    return sorted(attr() if callable(attr) else attr)


def hxfer_rank(hxfer, engine: str, model: str, tp: int, rank: int, **options) -> Rank:
    layout = hxfer.Layout.engine(engine, model=model, tp=tp, tp_rank=rank, **options)
    parts = {}
    for layer in layout.layers():
        for role in ("kv", "conv", "ssm"):
            try:
                records = layout.records(layer, role)
            except hxfer.Error:
                continue
            for r in records:
                sections = [s["name"] for s in r.get("sections", [])]
                what = sections[0] if role == "kv" and sections in (["K"], ["V"]) else ""
                parts.setdefault((layer, role), []).append(Part(
                    region=r["pool"], offset=r["offset"], index_stride=r["index_stride"],
                    dtype=r["dtype"], dims=[(d["name"], d["size"], d["stride"]) for d in r["dims"]],
                    what=what, state_group=r.get("state_group")))
    reserved = {}
    for kind in ("block", "slot"):
        ids = hxfer_reserved(layout, kind)
        if ids is not None:
            reserved[kind] = ids
    return Rank(parts=parts, regions={p["name"]: p["bytes"] for p in layout.pools()},
                tokens_per_block=layout.tokens_per_block, reserved=reserved)


# ---------------------------------------------------------------------------------------------
# Comparison


def element_offsets(torch, dims, names, sizes):
    """Byte offset of every element of a record (a tensor indexed by `names`, of `sizes`) from
    its element 0, by hxfer's rule: a dim named more than once is split, its index mixed radix
    over those dims, the first named the most significant. A string says why it cannot."""
    out = None
    for axis, (name, size) in enumerate(zip(names, sizes)):
        split = [(s, st) for n, s, st in dims if n == name]
        if not split or torch.tensor([s for s, _ in split]).prod().item() != size:
            return (f"{name} is {' x '.join(str(s) for s, _ in split) or 'missing'} in hxfer, "
                    f"{size} in the engine")
        index = torch.arange(size, dtype=torch.int64)
        off, inner = torch.zeros(size, dtype=torch.int64), size
        for s, st in split:
            inner //= s
            off += (index // inner) % s * st
        shape = [1] * len(names)
        shape[axis] = size
        off = off.view(shape)
        out = off if out is None else out + off
    extra = sorted({n for n, _, _ in dims} - set(names))
    if extra:
        return f"hxfer has dims {extra} the engine has not"
    return out


_ELEMENT_CHECKS = {}  # (hxfer dims, id of the measured map) -> (the map, its differences)


def compare_elements(where, hx: Part, en: Part) -> list:
    """hxfer's element offsets (from its dims) against the ones measured in the engine."""
    key = (tuple(hx.dims), id(en.elements))
    if key not in _ELEMENT_CHECKS:  # layers of one shape share both: check each pair once
        _ELEMENT_CHECKS[key] = (en.elements, element_differences(hx, en))
    return [f"{where}: {d}" for d in _ELEMENT_CHECKS[key][1]]


def element_differences(hx: Part, en: Part) -> list:
    import torch
    names = ("head", "token", "dim")
    hx_map = element_offsets(torch, hx.dims, names, tuple(en.elements.shape))
    if isinstance(hx_map, str):
        return [f"sizes: {hx_map}"]
    bad = (hx_map != en.elements).nonzero()
    if len(bad) == 0:
        return []
    h, t, d = (int(x) for x in bad[0])
    return [f"element order: {len(bad)} of {en.elements.numel()} elements elsewhere, "
            f"first (head {h}, token {t}, dim {d}) at hxfer +{int(hx_map[h, t, d])}, kernel "
            f"+{int(en.elements[h, t, d])} (hxfer dims "
            f"{','.join(f'{n}{s}@{st}' for n, s, st in hx.dims)})"]


def compare_parts(layer, role, hx: Part, en: Part, pool_map: dict, check_group: bool) -> list:
    where = f"layer {layer} {role}{(' ' + en.what) if en.what else ''}"
    out = []
    if hx.dtype != en.dtype:
        out.append(f"{where}: dtype hxfer {hx.dtype}, engine {en.dtype}")
    if en.elements is not None:  # measured: every element's place, instead of dims and strides
        out += compare_elements(where, hx, en)
        out += compare_place(where, layer, role, hx, en, pool_map, check_group)
        return out
    hn, enames = sorted(d[0] for d in hx.dims), sorted(d[0] for d in en.dims)
    if hn != enames:
        out.append(f"{where}: dims hxfer {hn}, engine {enames}")
        return out
    hs, es_ = {d[0]: d for d in hx.dims}, {d[0]: d for d in en.dims}
    sizes = [n for n in hs if hs[n][1] != es_[n][1]]
    if sizes:
        out.append(f"{where}: sizes " + ", ".join(
            f"{n} hxfer {hs[n][1]} engine {es_[n][1]}" for n in sizes))
        return out
    if hx.order() != en.order():
        out.append(f"{where}: dim order hxfer {'>'.join(hx.order())}, "
                   f"engine {'>'.join(en.order())}")
    strides = [n for n in hs if hs[n][1] > 1 and hs[n][2] != es_[n][2]]
    if strides:
        out.append(f"{where}: byte strides " + ", ".join(
            f"{n} hxfer {hs[n][2]} engine {es_[n][2]}" for n in strides))
    return out + compare_place(where, layer, role, hx, en, pool_map, check_group)


def compare_place(where, layer, role, hx: Part, en: Part, pool_map: dict,
                  check_group: bool) -> list:
    """Where a record is: its index stride, its region and offset, its state group."""
    out = []
    if hx.index_stride != en.index_stride:
        out.append(f"{where}: index stride (page) hxfer {hx.index_stride}, "
                   f"engine {en.index_stride}")
    mapped = pool_map.setdefault(hx.region, (en.region, en.offset - hx.offset))
    if mapped != (en.region, en.offset - hx.offset):
        out.append(f"{where}: hxfer pool {hx.region}+{hx.offset} is engine {en.region}+"
                   f"{en.offset}, but {hx.region} is {mapped[0]}{mapped[1]:+d} for earlier "
                   "records")
    elif mapped[1] != 0:
        out.append(f"{where}: offset hxfer {hx.region}+{hx.offset}, engine {en.region}+"
                   f"{en.offset}")
    if check_group and role != "kv" and hx.state_group != en.state_group:
        out.append(f"{where}: state group hxfer {hx.state_group}, engine {en.state_group}")
    return out


def compare_rank(hx: Rank, en: Rank, check_group: bool) -> list:
    diffs = []
    if en.tokens_per_block is not None and hx.tokens_per_block != en.tokens_per_block:
        diffs.append(f"tokens per block hxfer {hx.tokens_per_block}, engine {en.tokens_per_block}")
    for kind, ids in en.reserved.items():
        got = hx.reserved.get(kind)
        if got is None:
            diffs.append(f"{kind} ids {ids} are the engine's dummy (never a request's); "
                         f"hxfer's layout does not say so")
        elif got != ids:
            diffs.append(f"reserved {kind} ids hxfer {got}, engine {ids}")
    keys = sorted(set(hx.parts) | set(en.parts))
    pool_map = {}
    for key in keys:
        layer, role = key
        h, e = hx.parts.get(key), en.parts.get(key)
        if not h or not e:
            diffs.append(f"layer {layer} {role}: only {'hxfer' if h else 'the engine'} has it")
            continue
        if len(h) != len(e) or any(("kv" in [d[0] for d in p.dims]) for p in h + e):
            h = sorted((q for p in h for q in p.split_kv()), key=lambda p: p.what)
            e = sorted((q for p in e for q in p.split_kv()), key=lambda p: p.what)
            # Compare as one record where both sides hold K and V in one: dim order then
            # shows where `kv` sits.
            if all(len(p) == 2 for p in (h, e)) and all(p.elements is None for p in e):
                try:
                    h, e = [merge_kv(*h)], [merge_kv(*e)]
                except AssertionError:
                    pass
        if len(h) != len(e):
            diffs.append(f"layer {layer} {role}: hxfer has {len(h)} parts, engine {len(e)}")
            continue
        if all(p.what for p in h + e):  # K and V as parts of their own on both sides
            h, e = sorted(h, key=lambda p: p.what), sorted(e, key=lambda p: p.what)
        for hp, ep in zip(h, e):
            diffs += compare_parts(layer, role, hp, ep, pool_map, check_group)
    for pool, (region, delta) in sorted(pool_map.items()):
        if pool in hx.regions and region in en.regions and \
                hx.regions[pool] != en.regions[region] - delta:
            diffs.append(f"pool {pool}: {hx.regions[pool]} bytes, engine {region} "
                         f"{en.regions[region] - delta} bytes")
    return diffs


# ---------------------------------------------------------------------------------------------
# Presets


def preset_config(model: str) -> dict:
    with open(os.path.join(PRESETS_DIR, model, "config.json")) as f:
        return json.load(f)


def engine_dtypes(kv, state) -> dict:
    """hxfer.Layout.engine's dtype options for the engine's kv and (conv, ssm) dtypes."""
    out = {"kv_dtype": dtype_name(kv)} if kv is not None else {}
    if state:
        out.update(conv_dtype=dtype_name(state[0]), ssm_dtype=dtype_name(state[1]))
    return out


class Skip(Exception):
    """The engine refuses this (model, tp): the message is its reason."""


def engine_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    tb = traceback.extract_tb(e.__traceback__)[-1]
    return (f"{type(e).__name__}{': ' + text[:160] if text else ''} "
            f"({os.path.basename(tb.filename)}:{tb.lineno} {tb.name})")


@contextlib.contextmanager
def quiet():
    """Engines print at import and on every config; keep the table readable."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield


# ---------------------------------------------------------------------------------------------
# vLLM 0.32


class Vllm:
    VARIANTS = {
        # name: (attention backend, VLLM_KV_CACHE_LAYOUT, VLLM_SSM_CONV_STATE_LAYOUT, hxfer kv,
        #        conv, the CPU attention kernel's ISA: "vec" as on a CPU without AMX tiles)
        "vllm": ("FLASH_ATTN", None, None, "nhd", "sd", None),  # GPU defaults
        "vllm hnd/ds": ("FLASH_ATTN", "HND", "DS", "hnd", "ds", None),  # what Nixl asks for
        "vllm-cpu": ("CPU_ATTN", None, None, "cpu", "sd", "vec"),  # the CPU backend
        "vllm-cpu amx": ("CPU_ATTN", None, None, "cpu-amx", "sd", "amx"),  # with AMX tiles
    }

    def __init__(self):
        with quiet():
            import torch
            import vllm
            from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig
            from vllm.model_executor.layers.attention.attention import Attention
            from vllm.model_executor.layers.mamba import mamba_mixer2, mamba_utils
            from vllm.model_executor.layers.mamba.abstract import MambaBase
            from vllm.model_executor.models import ModelRegistry
            from vllm.platforms.interface import Platform
            from vllm.v1.attention.backend import AttentionType
            from vllm.v1.attention.backends import utils as backend_utils
            from vllm.platforms import cpu as cpu_platform
            from vllm.v1.attention.backends import cpu_attn
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
            from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
            from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
            from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
            from vllm.v1.core import kv_cache_utils
            from vllm.v1.core.block_pool import BlockPool
            from vllm.v1.worker.utils import allocate_kv_cache, customize_attention_spec
        self.version = vllm.__version__
        self.torch = torch
        self.m = SimpleNamespace(**{k: v for k, v in locals().items() if k != "self"})
        self.backends = {"FLASH_ATTN": (FlashAttentionBackend, FlashAttentionImpl.forward,
                                        ("token", "head", "dim")),
                         "CPU_ATTN": (CPUAttentionBackend, CPUAttentionBackendImpl.
                                      do_kv_cache_update, ("head", "token", "dim"))}
        self.model_configs = {}

    def cpu_kernel_isa(self, dtype, block_size, head_size, cache_dtype, want):
        """The ISA vLLM's CPU backend picks for these (cpu_attn._get_attn_isa, executed): for
        `want` "vec" as on a CPU without AMX tiles, for "amx" on this CPU, which must have them
        and for which vLLM must pick amx; otherwise the variant is skipped with the reason."""
        torch, pick = self.torch, self.m.cpu_attn._get_attn_isa
        if want == "amx":
            if not torch.cpu._is_amx_tile_supported():
                raise Skip("this CPU has no AMX tiles (torch.cpu._is_amx_tile_supported() is "
                           "False): the amx kernel cannot run here")
            isa = pick(dtype, block_size, head_size, cache_dtype)
            if isa != "amx":
                rules = [ln.strip().rstrip(":") for ln in inspect.getsource(pick).splitlines()
                         if ln.strip().startswith(("if head_size", "if supports_amx"))]
                raise Skip(f"vLLM's _get_attn_isa picks {isa}, not amx, for "
                           f"{dtype_name(dtype)} kv, block_size {block_size}, head_size "
                           f"{head_size} ({'; '.join(rules)})")
            return isa
        real = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: False  # a CPU without AMX tiles
        try:
            return pick(dtype, block_size, head_size, cache_dtype)
        finally:
            torch.cpu._is_amx_tile_supported = real

    def measure_cpu_kv(self, view, head_size, isa, cache_dtype):
        """Where vLLM's CPU attention kernel puts each K and V element of a block: runs
        ops.cpu_attn_reshape_and_cache (the installed _C, what do_kv_cache_update calls) on a
        real 2-block cache with the layer view's block shape and strides, split by the
        backend's own statements, writing block 1 in full four times, each time with the
        elements' kv, head, token or dim index coded as a distinct finite value. Returns the K
        and V maps: (H, T, D) byte offsets from each view's element 0 of a block."""
        torch = self.torch
        with quiet():
            import vllm._C  # noqa: F401  (registers torch.ops._C)
            from vllm import _custom_ops as ops
        es = view.element_size()
        itype, code0 = {2: (torch.int16, 0x3F80), 4: (torch.int32, 0x3F800000)}[es]
        block = view.stride(0)  # elements per block (page)
        flat = torch.zeros(2 * block, dtype=view.dtype)
        cache = flat.as_strided((2,) + tuple(view.shape[1:]), view.stride())
        key_cache, value_cache, _ = run_kv_split(self.backends["CPU_ATTN"][1], cache, head_size)
        H, T, D = key_cache.shape[1], key_cache.shape[2], head_size
        assert max(H, T, D) < 0x4000, (H, T, D)  # codes stay finite, positive, normal
        grid = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(D), indexing="ij")
        zero = torch.zeros(T, H, D, dtype=torch.int64)
        coords = {"kv": (zero, zero + 1), "head": (grid[1], grid[1]),
                  "token": (grid[0], grid[0]), "dim": (grid[2], grid[2])}
        slots = torch.arange(T, 2 * T, dtype=torch.int64)  # every token of block 1
        got = {}
        for name, (kval, vval) in coords.items():
            flat.zero_()
            key = (kval + code0).to(itype).view(view.dtype).contiguous()
            value = (vval + code0).to(itype).view(view.dtype).contiguous()
            try:
                ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                               kv_cache_dtype=cache_dtype)
            except RuntimeError as e:
                supported = self.m.CPUAttentionBackend.get_supported_head_sizes()
                raise Skip(f"vLLM's CPU attention kernel refuses it: {str(e).splitlines()[0]} "
                           f"(CPUAttentionBackend head sizes {supported})")
            got[name] = flat.view(itype).to(torch.int64)
        pos = (got["kv"] != 0).nonzero().flatten()
        if len(pos) != 2 * H * T * D or int(pos.min()) < block or int(pos.max()) >= 2 * block:
            raise AssertionError(f"the {isa} kernel wrote {len(pos)} elements in [{pos.min()}, "
                                 f"{pos.max()}], not the {2 * H * T * D} of block 1 "
                                 f"[{block}, {2 * block})")
        idx = {n: got[n][pos] - code0 for n in coords}
        maps = []
        for kv, part in enumerate((key_cache, value_cache)):
            sel = idx["kv"] == kv
            m = torch.full((H, T, D), -1, dtype=torch.int64)
            m[idx["head"][sel], idx["token"][sel], idx["dim"][sel]] = pos[sel]
            if int(sel.sum()) != H * T * D or bool((m < 0).any()):
                raise AssertionError(f"the {isa} kernel's {'KV'[kv]} elements are not one each")
            maps.append((m - part[1].storage_offset()) * es)
        return tuple(maps)

    def model_config(self, model):
        if model not in self.model_configs:
            path = os.path.join(PRESETS_DIR, model)
            with quiet():
                self.model_configs[model] = self.m.ModelConfig(
                    model=path, tokenizer=path, skip_tokenizer_init=True)
        return self.model_configs[model]

    def n_groups_rule(self, hf, tp):
        """MambaMixer2.__init__ asserts `(n_groups % self.tp_size) == 0 or n_groups == 1`
        (mamba_mixer2.py); the mixer needs a process group to build, so the rule is read from
        its source and evaluated here, failing loudly if the source no longer says it."""
        src = inspect.getsource(self.m.mamba_mixer2.MambaMixer2.__init__)
        rule = "(n_groups % self.tp_size) == 0 or n_groups == 1"
        if rule not in src:
            raise AssertionError("MambaMixer2.__init__ no longer asserts " + rule)
        n_groups = getattr(hf, "n_groups", None) or getattr(hf, "mamba_n_groups", None)
        if n_groups is not None and not (n_groups % tp == 0 or n_groups == 1):
            raise Skip(f"MambaMixer2 asserts {rule} (n_groups={n_groups}, tp={tp})")

    def layer_kinds(self, mc):
        """Per global layer: (has attention, mamba kind or None), from the HF config fields the
        vLLM model classes read to build their layers."""
        hf, arch = mc.hf_config, mc.architecture
        if arch == "NemotronHForCausalLM":  # nemotron_h.py: config.hybrid_override_pattern
            return [(c == "*", "mamba2" if c == "M" else None) for c in hf.hybrid_override_pattern]
        def table(module, types):  # the decoder layer class the model builds for each layer
            classes = importlib.import_module(
                f"vllm.model_executor.models.{module}").ALL_DECODER_LAYER_TYPES
            return [classes[t].__name__ for t in types]

        if arch == "GraniteMoeHybridForCausalLM":  # granitemoehybrid.py: config.layer_types
            return [("Attention" in c, "mamba2" if "Mamba" in c else None)
                    for c in table("granitemoehybrid", hf.layer_types)]
        if arch == "Qwen3NextForCausalLM":  # qwen3_next.py: config.layer_types
            return [(t == "full_attention", "gdn" if t == "linear_attention" else None)
                    for t in hf.layer_types]
        if arch == "JambaForCausalLM":  # jamba.py: config.layers_block_type
            return [("Attention" in c, "mamba1" if "Mamba" in c else None)
                    for c in table("jamba", hf.layers_block_type)]
        if arch == "FalconH1ForCausalLM":  # falcon_h1.py: attention and mamba in every layer
            return [(True, "mamba2")] * hf.num_hidden_layers
        if arch == "Mamba2ForCausalLM":
            return [(False, "mamba2")] * hf.num_hidden_layers
        raise Skip(f"no layer map for {arch}")

    def rank(self, model, tp, variant) -> Rank:
        m, torch = self.m, self.torch
        backend_name, kv_env, conv_env, _, _, isa = self.VARIANTS[variant]
        backend, split_fn, kv_labels = self.backends[backend_name]
        for name, value in (("VLLM_KV_CACHE_LAYOUT", kv_env),
                            ("VLLM_SSM_CONV_STATE_LAYOUT", conv_env)):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        m.mamba_utils.get_conv_state_layout.cache_clear()
        mc = self.model_config(model)
        mc.config_updated = False
        cfg = SimpleNamespace(
            model_config=mc, cache_config=m.CacheConfig(),
            parallel_config=m.ParallelConfig(tensor_parallel_size=tp),
            scheduler_config=SimpleNamespace(enable_chunked_prefill=True,
                                             disable_hybrid_kv_cache_manager=False),
            speculative_config=None, num_speculative_tokens=0, kv_transfer_config=None,
            attention_config=SimpleNamespace(hisparse_config=None))
        with quiet():
            m.VllmConfig.try_verify_and_update_config(cfg)  # the model's cache hooks
        kinds = self.layer_kinds(mc)
        model_cls, _ = m.ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
        mamba_kinds = {k for _, k in kinds if k}
        if "mamba2" in mamba_kinds:
            self.n_groups_rule(mc.hf_config, tp)
        notes, hx_options = [], {}
        if backend_name == "CPU_ATTN":
            # CpuPlatform.check_and_update_config runs after the model's hooks (VllmConfig.
            # __post_init__): its block size (128 unless the user gives one) and its ssm dtype
            # (float32 on a CPU with AVX512-BF16, bar the accelerated GDN in 16-bit), executed
            # from its source before the state dtypes are read.
            run_cpu_platform_cache_rules(m.cpu_platform, cfg)
            ssm = cfg.cache_config.mamba_ssm_cache_dtype
            notes.append(f"CpuPlatform: block_size {cfg.cache_config.block_size}, "
                         f"mamba_ssm_cache_dtype {ssm}")
            if ssm == "float32" and mamba_kinds:
                hx_options["ssm_dtype"] = "fp32"  # what a CPU user says
        try:
            shapes = tuple(model_cls.get_mamba_state_shape_from_config(cfg)) if mamba_kinds else ()
            dtypes = tuple(model_cls.get_mamba_state_dtype_from_config(cfg)) if mamba_kinds else ()
        except (AssertionError, ValueError) as e:
            raise Skip("vLLM: " + engine_error(e))
        has_attention = any(a for a, _ in kinds)

        class OneBackend(m.Platform):  # the backends vLLM reads off the built model's layers
            @classmethod
            def _find_non_ssm_backends(cls, vllm_config):
                return [backend] if has_attention else []

        with quiet():
            if has_attention:
                if not cfg.cache_config.user_specified_block_size and backend_name != "CPU_ATTN":
                    cfg.cache_config.block_size = OneBackend._preferred_block_size_for_backends(
                        [backend], m.CacheConfig.DEFAULT_BLOCK_SIZE, cfg)
                start_block = cfg.cache_config.block_size  # before the hybrid alignment
                if mc.is_hybrid:
                    OneBackend._align_hybrid_block_size(cfg, backend)
        head_size = mc.get_head_size()
        kernel = None
        if backend_name == "CPU_ATTN" and has_attention:
            kernel = self.cpu_kernel_isa(mc.dtype, cfg.cache_config.block_size, head_size,
                                         cfg.cache_config.cache_dtype, isa)
            notes.append(f"kv element order measured by running cpu_attn_reshape_and_cache "
                         f"isa={kernel} on 2 blocks of {cfg.cache_config.block_size} tokens "
                         f"(vLLM's block size), head_dim {head_size}")
        attn_self = SimpleNamespace(
            attn_type=m.AttentionType.DECODER, kv_cache_dtype=cfg.cache_config.cache_dtype,
            sliding_window=None, num_kv_heads=mc.get_num_kv_heads(cfg.parallel_config),
            head_size=head_size, head_size_v=head_size, kv_cache_torch_dtype=mc.dtype,
            attn_backend=backend)
        enum = m.MambaAttentionBackendEnum
        mamba_type = {"mamba2": enum.MAMBA2, "mamba1": enum.MAMBA1, "gdn": enum.GDN_ATTN}
        specs, owner = {}, {}
        for i, (attn, kind) in enumerate(kinds):
            if attn:
                name = f"model.layers.{i}.self_attn.attn"
                specs[name] = m.customize_attention_spec(
                    backend, m.Attention.get_kv_cache_spec(attn_self, cfg))
                owner[name] = (i, "attn", None)
            if kind:
                name = f"model.layers.{i}.mixer"
                mamba_self = SimpleNamespace(
                    get_state_shape=lambda: shapes, get_state_dtype=lambda: dtypes,
                    mamba_type=mamba_type[kind], is_kv_cache_tp_replicated=False)
                specs[name] = m.MambaBase.get_kv_cache_spec(mamba_self, cfg)
                owner[name] = (i, "mamba", mamba_self)
        supported = [x.name for x in m.backend_utils.get_supported_kv_cache_layouts([backend])]
        with quiet():
            layout = m.backend_utils.resolve_kv_cache_layout(cfg, [supported], specs.values())
            groups = m.kv_cache_utils.get_kv_cache_groups(cfg, specs)
            per_block = m.kv_cache_utils._get_kv_cache_bytes_per_block(groups, layout)
            kc = m.kv_cache_utils.get_kv_cache_config_from_groups(cfg, groups,
                                                                  per_block * NUM_BLOCKS)
            views = m.allocate_kv_cache(kc, torch.device("meta"), layout,
                                        [g.kv_cache_spec.block_size for g in groups])
        mamba_group = {}  # layer name -> which Mamba group (their order in `groups`)
        mamba_groups = [g for g in groups if type(g.kv_cache_spec).__name__ == "MambaSpec"]
        for gi, g in enumerate(mamba_groups):
            mamba_group.update((n, gi) for n in g.layer_names)
        # A KV cache tensor of S layers is S regions of layer_stride bytes (slot t: the t-th
        # layer of every group); its layers' views start at offset + t * layer_stride.
        strides = {t.layer_stride for t in kc.kv_cache_tensors}
        assert len(strides) == 1, strides
        region_bytes = strides.pop()
        slots = max(len(t.layers) for t in kc.kv_cache_tensors)
        regions = {f"slot{t}": region_bytes for t in range(slots)}

        def region_of(view):
            start = view.storage_offset() * view.element_size()
            return f"slot{start // region_bytes}", (start // region_bytes) * region_bytes

        parts, measured = {}, {}
        for name, view in views.items():
            layer, what, mamba_self = owner[name]
            region, base = region_of(view)
            if what == "attn":
                k, v, _ = run_kv_split(split_fn, view, head_size)
                kp = from_tensor(k, kv_labels, region, base, "K")
                vp = from_tensor(v, kv_labels, region, base, "V")
                if kernel:  # the view's dims are not where the kernel writes: measure
                    key = (tuple(view.shape[1:]), tuple(view.stride()), view.dtype)
                    if key not in measured:
                        measured[key] = self.measure_cpu_kv(view, head_size, kernel,
                                                            cfg.cache_config.cache_dtype)
                    kp.elements, vp.elements = measured[key]
                    parts[(layer, "kv")] = [kp, vp]
                    continue
                try:
                    parts[(layer, "kv")] = [merge_kv(kp, vp)]
                except AssertionError:
                    parts[(layer, "kv")] = [kp, vp]
            else:
                m.MambaBase.bind_kv_cache(mamba_self, view)  # the layer's own unpacking
                conv, ssm = mamba_self.kv_cache[:2]
                kind = kinds[layer][1]
                # MambaStateShapeCalculator: conv (k-1, C) when SD, (C, k-1) when DS; ssm
                # mamba2 (heads, head_dim, state), gdn (v_heads, head_v, head_k), mamba1
                # (d_inner, state).
                conv_labels = (("channel", "window") if m.mamba_utils.is_conv_state_dim_first()
                               else ("window", "channel"))
                ssm_labels = {"mamba2": ("head", "head_dim", "state"),
                              "gdn": ("head", "value", "key"),
                              "mamba1": ("channel", "state")}[kind]
                group = mamba_group[name]
                parts[(layer, "conv")] = [from_tensor(conv, conv_labels, region, base,
                                                      state_group=group)]
                parts[(layer, "ssm")] = [from_tensor(ssm, ssm_labels, region, base,
                                                     state_group=group)]
        # Block 0 is the null block: BlockPool never hands it to a request.
        with quiet():
            pool = m.BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=False,
                               hash_block_size=cfg.cache_config.block_size)
        free = sorted(b.block_id for b in pool.get_new_blocks(pool.get_num_free_blocks()))
        reserved = sorted(set(range(NUM_BLOCKS)) - set(free))
        attn_block = cfg.cache_config.block_size if has_attention else None
        rank = Rank(parts=parts, regions=regions, tokens_per_block=attn_block,
                    reserved={"block": reserved}, notes=notes,
                    dtypes=engine_dtypes(mc.dtype if has_attention else None, dtypes))
        rank.hx_options = hx_options
        rank.start_block = start_block if has_attention else None
        rank.info = {
            "layout": layout.name, "block_size": attn_block, "cpu_isa": kernel,
            "page_bytes": next(iter(kc.kv_cache_tensors)).block_stride,
            "mamba_page_padded": cfg.cache_config.mamba_page_size_padded,
            "ssm_dtype": cfg.cache_config.mamba_ssm_cache_dtype,
            "conv_layout": m.mamba_utils.get_conv_state_layout(),
            "groups": [f"{type(g.kv_cache_spec).__name__[:-4]}{len(g.layer_names)}"
                       for g in groups],
            "tensors": slots}
        return rank


def run_cpu_platform_cache_rules(cpu_platform, cfg):
    """Executes CpuPlatform.check_and_update_config's statements from `cache_config =
    vllm_config.cache_config` through its ssm dtype rule (`if torch.cpu.
    _is_avx512_bf16_supported() and cache_config.mamba_ssm_cache_dtype != "float32": ...`),
    taken from its source: the block size (128 unless the user gave one; 16 / 256 for MLA /
    DeepSeek-V4) and the ssm cache dtype. The rest of the method (environment variables,
    compilation, workers) is not run."""
    method = cpu_platform.CpuPlatform.check_and_update_config
    fn = ast.parse(textwrap.dedent(inspect.getsource(method))).body[0]
    text = [ast.unparse(st) for st in fn.body]
    first = [i for i, t in enumerate(text) if t == "cache_config = vllm_config.cache_config"]
    last = [i for i, t in enumerate(text) if t.startswith("if ") and
            "_is_avx512_bf16_supported" in t and "mamba_ssm_cache_dtype" in t]
    if not first or not last or last[0] < first[0] or not any(
            "cache_config.block_size = 128" in t for t in text[first[0]:last[0]]):
        raise AssertionError("CpuPlatform.check_and_update_config no longer sets block_size "
                             "and the ssm dtype as this check reads it")
    code = "\n".join(text[first[0]:last[0] + 1])
    if not hasattr(cfg.attention_config, "backend"):
        cfg.attention_config.backend = None  # no --attention-backend
    scope = {"cls": cpu_platform.CpuPlatform, "vllm_config": cfg,
             "model_config": cfg.model_config}
    with quiet():
        exec(code, dict(vars(cpu_platform)), scope)
    return code


def run_kv_split(method, kv_cache, head_size):
    """Runs the attention backend's own statements that split its per-layer view into
    key_cache and value_cache (FlashAttention's forward: `kv_cache.transpose(1, 2).split(
    self.head_size, dim=-1)`; the CPU backend's view + chunk), taken from its source."""
    fn = ast.parse(textwrap.dedent(inspect.getsource(method))).body[0]
    for node in ast.walk(fn):
        for field in ("body", "orelse"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list):
                continue
            for i, st in enumerate(stmts):
                if (isinstance(st, ast.Assign) and isinstance(st.targets[0], ast.Tuple) and
                        [getattr(e, "id", None) for e in st.targets[0].elts] ==
                        ["key_cache", "value_cache"]):
                    j = i
                    while j > 0 and isinstance(stmts[j - 1], ast.Assign) and \
                            "kv_cache" in ast.unparse(stmts[j - 1]):
                        j -= 1
                    code = "\n".join(ast.unparse(s) for s in stmts[j:i + 1])
                    scope = {"kv_cache": kv_cache, "self": SimpleNamespace(head_size=head_size)}
                    exec(code, {}, scope)
                    return scope["key_cache"], scope["value_cache"], code
    raise AssertionError(f"{method.__qualname__} no longer splits key_cache, value_cache")


# ---------------------------------------------------------------------------------------------
# SGLang 0.5.23


class Sglang:
    def __init__(self):
        with quiet():
            import importlib.util

            import sglang
            import torch
            import transformers
            from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
            from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
            from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool
            from sglang.srt.runtime_context import get_parallel
            from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY
        self.version = sglang.__version__
        self.torch = torch
        self.m = SimpleNamespace(**{k: v for k, v in locals().items() if k != "self"})

    def config(self, model):
        d = preset_config(model)
        cls = self.m._CONFIG_REGISTRY.get(d["model_type"])
        if cls is None:
            cls = type(self.m.transformers.AutoConfig.for_model(d["model_type"]))
        arch = d["architectures"][0]
        module = {"JambaForCausalLM": "jamba"}.get(arch)
        if module and self.m.importlib.util.find_spec(f"sglang.srt.models.{module}") is None:
            raise Skip(f"SGLang {self.version} has no {arch} (no sglang.srt.models.{module})")
        return cls(**{k: v for k, v in d.items() if k != "model_type"})

    def rank(self, model, tp) -> Rank:
        m, torch = self.m, self.torch
        with quiet():
            cfg = self.config(model)
        try:
            with m.get_parallel().override(tp_size=tp, attn_tp_size=tp, attn_dp_size=1,
                                           attn_cp_size=1, enable_cp_tp_group_sharing=False):
                params = cfg.mamba2_cache_params
        except Exception as e:
            raise Skip("SGLang: " + engine_error(e))
        shape = params.shape
        attn_layers = list(getattr(cfg, "full_attention_layer_ids", []) or [])
        parts, regions = {}, {}
        reserved = {}
        # KV: ModelConfig.get_num_kv_heads is max(1, total // tp) (configs/model_config.py).
        if attn_layers:
            total_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            head_num = max(1, total_kv // tp)
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            num_pages = NUM_BLOCKS - 1  # page 0 is the padded page on top
            with quiet():
                kv = m.MHATokenToKVPool(
                    size=num_pages * SGLANG_PAGE_SIZE, page_size=SGLANG_PAGE_SIZE,
                    dtype=torch.bfloat16, head_num=head_num, head_dim=head_dim,
                    layer_num=len(attn_layers), device="cpu", enable_memory_saver=False,
                    enable_alt_stream=False)
                _, lens, item_lens = kv.get_contiguous_buf_infos()[:3]
            n = len(attn_layers)
            for i, layer in enumerate(attn_layers):
                for what, buf, j in (("K", kv.k_buffer[i], i), ("V", kv.v_buffer[i], n + i)):
                    region = f"{what.lower()}.{layer}"
                    regions[region] = lens[j]
                    # (rows, H, D) token rows; a page is page_size consecutive rows.
                    pages = buf.unflatten(0, (-1, SGLANG_PAGE_SIZE))
                    p = from_tensor(pages, ("token", "head", "dim"), region,
                                    buf.storage_offset() * buf.element_size(), what)
                    assert p.index_stride == item_lens[j], (p.index_stride, item_lens[j])
                    parts.setdefault((layer, "kv"), []).append(p)
            with quiet():
                alloc = m.PagedTokenToKVPoolAllocator(
                    size=num_pages * SGLANG_PAGE_SIZE, page_size=SGLANG_PAGE_SIZE,
                    dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
            handed = sorted(int(x) for x in alloc.free_pages.tolist())
            reserved["block"] = sorted(set(range(num_pages + 1)) - set(handed))
        with quiet():
            pool = m.MambaPool(size=SGLANG_SLOTS, spec_state_size=SGLANG_SLOTS,
                               cache_params=params, mamba_layer_ids=params.layers, device="meta")
            slots = m.MambaSlotAllocator(SGLANG_SLOTS, "cpu")
        handed = sorted(int(x) for x in slots.free_slots.tolist())
        reserved["slot"] = sorted(set(range(SGLANG_SLOTS + 1)) - set(handed))
        conv, temporal = pool.mamba_cache.conv[0], pool.mamba_cache.temporal
        regions["conv"], regions["temporal"] = conv.nbytes, temporal.nbytes
        # Mamba2StateShape.create: conv (conv_dim/tp, k-1), temporal (heads/tp, head_dim,
        # state); GDN through it (qwen3_next.py) (v_heads/tp, head_v, head_k).
        gdn = type(cfg).__name__.startswith("Qwen3")
        ssm_labels = ("head", "value", "key") if gdn else ("head", "head_dim", "state")
        for li, layer in enumerate(params.layers):
            parts[(layer, "conv")] = [from_tensor(conv[li], ("channel", "window"), "conv", 0)]
            parts[(layer, "ssm")] = [from_tensor(temporal[li], ssm_labels, "temporal", 0)]
        rank = Rank(parts=parts, regions=regions,
                    tokens_per_block=SGLANG_PAGE_SIZE if attn_layers else None,
                    reserved=reserved, dtypes=engine_dtypes(
                        torch.bfloat16 if attn_layers else None,
                        (params.dtype.conv, params.dtype.temporal)))
        rank.info = {"conv": list(shape.conv[0]), "temporal": list(shape.temporal),
                     "dtypes": [dtype_name(params.dtype.conv), dtype_name(params.dtype.temporal)],
                     "kv_pages_incl_dummy": NUM_BLOCKS, "mamba_slots_incl_dummy": SGLANG_SLOTS + 1}
        return rank


# ---------------------------------------------------------------------------------------------
# Driver


BLOCK_SIZE_NAMED = {  # backend: how hxfer's refusal names what vLLM picks with it
    "FLASH_ATTN": (r"(\d+) tokens per block with FlashAttention", "with FlashAttention"),
    "CPU_ATTN": (r"(\d+) on CPU\b", "on CPU"),
}


def hxfer_block_size_check(hxfer, model, tp, engine_block, start_block, backend,
                           options) -> list:
    """vLLM's attention block size: hxfer must take the engine's, and where it refuses the block
    size vLLM starts from (the backend's default, before the hybrid alignment) it must name the
    engine's for this backend (`it picks N tokens per block with FlashAttention, M on CPU`)."""
    import re
    out = []
    if not engine_block or not start_block:
        return out
    pattern, label = BLOCK_SIZE_NAMED[backend]
    try:
        hxfer.Layout.engine("vllm", model=model, tp=tp, tokens_per_block=start_block, **options)
        if engine_block > start_block:
            out.append(f"block size: hxfer takes {start_block} tokens per block, vLLM raises it "
                       f"to {engine_block}")
    except hxfer.Error as e:
        if "tokens per block" in str(e):
            named = re.search(pattern, str(e))
            if not named:
                out.append(f"block size: hxfer's refusal names no block size {label}: "
                           f"{str(e)[:200]}")
            elif int(named.group(1)) != engine_block:
                out.append(f"block size: hxfer names {named.group(1)} tokens per block {label}, "
                           f"vLLM picks {engine_block}")
    return out


def run(args) -> list:
    rows = []
    try:
        import hxfer
    except ImportError as e:
        sys.exit(f"cannot import hxfer ({e}): set PYTHONPATH to build/python or install it")
    models = args.models or sorted(os.listdir(PRESETS_DIR))
    engines = []
    if "vllm" in args.engines:
        vllm = Vllm()
        engines += [(v, vllm) for v in Vllm.VARIANTS]
    if "sglang" in args.engines:
        engines.append(("sglang", Sglang()))
    for name, eng in engines:
        for model in models:
            for tp in args.tp:
                row = {"engine": name, "model": model, "tp": tp, "status": "PASS", "diffs": [],
                       "notes": []}
                t0 = time.time()
                try:
                    if isinstance(eng, Vllm):
                        rank = eng.rank(model, tp, name)
                        backend, _, _, kv, conv, _ = Vllm.VARIANTS[name]
                        options = dict(num_blocks=NUM_BLOCKS, kv_layout=kv, conv_layout=conv,
                                       shared_tensors="on", **rank.hx_options)
                        if rank.hx_options:
                            row["notes"].append(f"hxfer told {rank.hx_options}")
                        pre = hxfer_block_size_check(hxfer, model, tp, rank.tokens_per_block,
                                                     rank.start_block, backend, options)
                        hx_engine, check_group = "vllm", True
                        options["tokens_per_block"] = rank.tokens_per_block or 16
                    else:
                        rank = eng.rank(model, tp)
                        options = dict(num_blocks=NUM_BLOCKS, num_slots=SGLANG_SLOTS + 1,
                                       tokens_per_block=SGLANG_PAGE_SIZE)
                        pre, hx_engine, check_group = [], "sglang", False
                    row["engine_info"] = getattr(rank, "info", {})
                    row["notes"] += rank.notes
                    for r in range(tp):
                        try:
                            hx = hxfer_rank(hxfer, hx_engine, model, tp, r, **options)
                        except hxfer.Error as e:
                            # Often the dtypes: say so, then compare the rest with hxfer told
                            # the engine's dtypes.
                            row["diffs"].append(f"rank {r}: hxfer refuses the engine's layout: "
                                                f"{str(e)[:200]}")
                            options.update(rank.dtypes)
                            row["notes"].append("compared with hxfer given the engine's dtypes "
                                                f"{rank.dtypes}")
                            try:
                                hx = hxfer_rank(hxfer, hx_engine, model, tp, r, **options)
                            except hxfer.Error as e2:
                                row["diffs"].append(f"rank {r}: hxfer refuses it with the "
                                                    f"engine's dtypes too: {str(e2)[:200]}")
                                break
                        diffs = compare_rank(hx, rank, check_group)
                        row["records"] = row.get("records", 0) + len(set(hx.parts) | set(rank.parts))
                        row["diffs"] += [f"rank {r}: {d}" for d in diffs]
                    row["diffs"] = pre + row["diffs"]
                    if row["diffs"]:
                        row["status"] = "FAIL"
                except Skip as e:
                    row["status"], row["reason"] = "SKIP", str(e)
                except Exception as e:  # an engine we could not drive is a failure of this check
                    row["status"] = "ERROR"
                    row["reason"] = engine_error(e)
                    if args.verbose:
                        traceback.print_exc()
                row["seconds"] = round(time.time() - t0, 1)
                rows.append(row)
                print_row(row, args.verbose)
    return rows


def first_distinct(diffs):
    """The first difference, with how many more (rank prefixes and layers folded)."""
    import re
    kinds = []
    for d in diffs:
        k = re.sub(r"^rank \d+: ", "", d)
        k = re.sub(r"layer \d+", "layer N", k)
        k = re.sub(r"pool (\w+)\.\d+", r"pool \1.N", re.sub(r"slot\d+", "slotN", k))
        k = re.sub(r"\+\d+", "+x", k) if "hxfer pool" in k else k
        if k not in kinds:
            kinds.append(k)
    return kinds


def print_row(row, verbose):
    head = (f"{row['status']:<5} {row['engine']:<12} {row['model']:<20} tp={row['tp']} "
            f"{row.get('records', 0):>4} rec")
    if row["status"] in ("SKIP", "ERROR"):
        print(f"{head}  {row['reason']}", flush=True)
        return
    kinds = first_distinct(row["diffs"])
    text = f"  {row['diffs'][0]}" if row["diffs"] else ""
    if len(kinds) > 1:
        text += f"  (+{len(kinds) - 1} more kinds, {len(row['diffs'])} differences)"
    print(head + text, flush=True)
    if verbose:
        for k in kinds[1:]:
            print(f"{'':45}{k}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write every row (all differences) as JSON")
    ap.add_argument("--engines", nargs="+", default=["vllm", "sglang"],
                    choices=["vllm", "sglang"])
    ap.add_argument("--models", nargs="+", help="preset names (default: every preset)")
    ap.add_argument("--tp", nargs="+", type=int, default=list(TPS))
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="print each kind of difference, and tracebacks")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    t0 = time.time()
    rows = run(args)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "FAIL", "SKIP", "ERROR")}
    print(f"{counts['PASS']} passed, {counts['FAIL'] + counts['ERROR']} failed, "
          f"{counts['SKIP']} skipped ({time.time() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "counts": counts}, f, indent=1, default=str)
    sys.exit(1 if counts["FAIL"] or counts["ERROR"] else 0)


if __name__ == "__main__":
    main()
