"""hxfer as a vLLM KV connector: prefill on one instance, decode on another, hybrid models too.

    kv_transfer_config={"kv_connector": "HxferConnector", "kv_connector_module_path": "hxfer.vllm",
                        "kv_role": "kv_producer" | "kv_consumer",
                        "kv_connector_extra_config": {...}}        # keys: EXTRA_CONFIG_KEYS

Written against vLLM 0.32 (the V1 connector API, KVConnectorBase_V1 + SupportsHMA) and its CPU
attention backend; docs/vllm.md says how to serve with it and what it supports.

The protocol is NixlPullConnector's for hybrids. The prefill instance P drops the last prompt token
of a model with Mamba/GDN layers (it computes N-1 tokens, max_tokens=1); when the request ends,
request_finished_all_groups keeps its blocks (delay_free) and returns kv_transfer_params naming
P's hxfer Senders (one per TP rank), the hxfer request id and P's blocks per KV cache group. P's
worker marks those pages ready in its Sender. The decode instance D reports N-1 external tokens
(N for a model without recurrent state), loaded asynchronously: its worker starts the request in
an hxfer Receiver, which asks P's ranks; they write the attention blocks and the state-bearing
Mamba block of every Mamba group into D's pages. D then recomputes the last prompt token. P frees
its blocks when hxfer releases them (every D rank got its answer, or the Sender's lease expired):
hxfer's on_released becomes vLLM's finished_sending. A failed load is reported per request
(failed_recving), never as block ids: with more than one KV cache group vLLM cannot map those to
requests.

The cache is described from the tensors vLLM registers (hxfer.tensors + Layout.from_records):
one pool per backing allocation (vLLM 0.32 has one), each attention layer's view read with the
CPU backend's per-head order for its ISA, each Mamba layer's raw page as conv then ssm with the
spec's shapes and dtypes. Nothing is copied: hxfer writes straight into vLLM's blocks.

`import hxfer` does not import this module; importing it needs vLLM.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

try:
    import torch
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.logger import init_logger
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.request import RequestStatus
except ImportError as e:  # vLLM absent, or a vLLM whose connector API moved
    raise ImportError(
        "hxfer.vllm is hxfer's vLLM KV connector and needs vLLM's V1 connector API "
        "(written for vLLM 0.32: KVConnectorBase_V1, SupportsHMA, KVConnectorTransferResults); "
        f"importing it failed: {e}. `import hxfer` itself does not need vLLM."
    ) from e

import hxfer
from hxfer.tensors import contiguous_record, tensor_record

logger = init_logger("vllm.hxfer")  # vLLM only shows loggers under "vllm."

__all__ = ["HxferConnector", "HxferConnectorMetadata", "HxferKVConnectorStats", "HxferPromMetrics",
           "HxferHandshakeMetadata", "EXTRA_CONFIG_KEYS", "describe_cache"]

CORRUPT_KEY = "test_corrupt_after_load"
CORRUPT_MODES = ("mamba_page", "conv", "kv_block")

# kv_connector_extra_config keys, with their defaults. docs/vllm.md explains each.
EXTRA_CONFIG_KEYS = {
    "token": None,            # shared secret of the P and D instances (else $HXFER_TOKEN)
    "backend": "auto",        # auto | ucx | shm
    "host": None,             # address P's Senders listen on (else $HXFER_HOST, else 127.0.0.1)
    "port": 0,                # P's first Sender port (rank r: port + r); 0 picks free ports
    "instance": None,         # the instance's name (all its ranks); default from engine_id
    "lease_timeout": 120.0,   # s: P frees blocks no decode instance asked for in this time
    "request_timeout": 30.0,  # s: D fails a load that has not completed in this time
    "stall_timeout": 30.0,    # s: P cancels a write to D that made no progress in this time
    "handshake_timeout": 10.0,
    "checksum": False,        # hash every transfer on both sides and compare
    "ucx_options": None,      # {"TLS": "tcp", ...}: UCX settings without the UCX_ prefix
    "model_config": None,     # path of the model's config.json (else found from the model)
    CORRUPT_KEY: None,        # negative control of tests/vllm (D only)
}

# D keeps one Receiver per prefill instance it loads from; past this many, the oldest idle one
# is closed (each holds a staging region, the pools' registration and threads).
MAX_RECEIVERS = 16

_TORCH_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# vLLM's CPU attention ISAs whose per-head order is described here (cpu_attn.py's _get_attn_isa).
_CPU_ISAS = ("vec", "vec16", "amx")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _hxfer_dtype(dtype: torch.dtype, what: str) -> str:
    try:
        return _TORCH_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"hxfer.vllm: {what} dtype {dtype} is not supported "
                         f"(supported: {', '.join(map(str, _TORCH_DTYPES))})") from None


def _layer_index(name: str) -> int:
    """The global layer id in a vLLM layer name ("model.layers.12.mixer" -> 12)."""
    ints = [int(p) for p in name.split(".") if p.isdigit()]
    if len(ints) != 1:
        raise ValueError(f"hxfer.vllm: cannot read one layer index from layer name {name!r}")
    return ints[0]


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass
class _Options:
    token: str
    backend: str
    host: str
    port: int
    instance: str | None
    lease_timeout: float
    request_timeout: float
    stall_timeout: float
    handshake_timeout: float
    checksum: bool
    ucx_options: dict[str, str] | None
    model_config: str | None
    corrupt: str | None

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> "_Options":
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"hxfer.vllm: kv_connector_extra_config has unknown keys {unknown} "
                             f"(known: {sorted(EXTRA_CONFIG_KEYS)})")
        get = lambda k: extra.get(k, EXTRA_CONFIG_KEYS[k])  # noqa: E731
        corrupt = get(CORRUPT_KEY)
        if corrupt is not None and corrupt not in CORRUPT_MODES:
            raise ValueError(f"kv_connector_extra_config[{CORRUPT_KEY!r}]={corrupt!r}: expected "
                             f"one of {CORRUPT_MODES}")
        backend = get("backend")
        if backend not in ("auto", "ucx", "shm"):
            raise ValueError(f"kv_connector_extra_config['backend']={backend!r}: expected auto, "
                             f"ucx or shm")
        seconds = {}
        for k in ("lease_timeout", "request_timeout", "stall_timeout", "handshake_timeout"):
            v = get(k)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or v <= 0):
                raise ValueError(f"kv_connector_extra_config[{k!r}]={v!r}: expected seconds > 0")
            seconds[k] = float(v)
        port = get("port")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"kv_connector_extra_config['port']={port!r}: expected 0..65535")
        ucx = get("ucx_options")
        if ucx is not None and (not isinstance(ucx, dict) or not all(
                isinstance(k, str) and isinstance(v, (str, int, float)) and not isinstance(v, bool)
                for k, v in ucx.items())):
            raise ValueError(f"kv_connector_extra_config['ucx_options']={ucx!r}: expected a dict "
                             f"of UCX setting names to strings or numbers")
        for k in ("token", "host", "instance", "model_config"):
            if get(k) is not None and not isinstance(get(k), str):
                raise ValueError(f"kv_connector_extra_config[{k!r}]={get(k)!r}: expected a string")
        if not isinstance(get("checksum"), bool):
            raise ValueError(f"kv_connector_extra_config['checksum']={get('checksum')!r}: "
                             f"expected true or false")
        return cls(token=get("token") or os.environ.get("HXFER_TOKEN", ""), backend=backend,
                   host=get("host") or os.environ.get("HXFER_HOST", "127.0.0.1"), port=port,
                   instance=get("instance"), checksum=get("checksum"),
                   ucx_options={str(k): str(v) for k, v in ucx.items()} if ucx else None,
                   model_config=get("model_config"), corrupt=corrupt, **seconds)


@dataclass(frozen=True)
class _Group:
    """One KV cache group as hxfer sees it: attention (the request's blocks) or a Mamba group
    (one state id per request; the first Mamba group is hxfer's slot, the others its
    group_slots, in vLLM's group order)."""
    index: int  # vLLM's group id
    kind: str  # "attention" | "mamba"
    spec: Any
    layer_names: tuple[str, ...]
    state_group: int = 0  # Mamba: 0 = slot, g = group_slots[g - 1]


def _groups_of(vllm_config, kv_cache_config, role_is_consumer: bool) -> list[_Group]:
    """The KV cache groups, checked against what hxfer moves. Raises ValueError naming what is
    not supported, so that an unsupported setup fails at startup, not mid-request."""
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise ValueError(f"hxfer.vllm: pipeline_parallel_size={pc.pipeline_parallel_size} is not "
                         f"supported (hxfer's API takes pp, this connector does not wire it yet)")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(pc, name, 1) != 1:
            raise ValueError(f"hxfer.vllm: {name}={getattr(pc, name)} is not supported")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise ValueError(f"hxfer.vllm: kv_cache_dtype={cache_dtype!r} is not supported "
                         f"(quantized KV caches are not described; use 'auto')")
    groups, mamba = [], 0
    transfer = set(kv_cache_config.transfer_group_ids)
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        where = f"KV cache group {i} ({type(spec).__name__}, layers {list(g.layer_names)[:3]}...)"
        if i not in transfer:
            raise ValueError(f"hxfer.vllm: {where} is not a transfer group")
        if type(spec) is FullAttentionSpec:
            bad = [f"{k}={getattr(spec, k)!r}" for k in ("sliding_window", "attention_chunk_size",
                                                         "num_head_slots", "state_content_bytes")
                   if getattr(spec, k, None) is not None]
            if spec.head_size_v != spec.head_size:
                bad.append(f"head_size_v={spec.head_size_v} != head_size={spec.head_size}")
            if getattr(spec.kv_quant_mode, "name", "NONE") != "NONE":
                bad.append(f"kv_quant_mode={spec.kv_quant_mode}")
            if bad:
                raise ValueError(f"hxfer.vllm: {where}: {', '.join(bad)} is not supported "
                                 f"(full attention with dense K and V only)")
            groups.append(_Group(i, "attention", spec, tuple(g.layer_names)))
        elif isinstance(spec, MambaSpec):
            kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
            if kind not in ("MAMBA2", "GDN_ATTN"):
                raise ValueError(f"hxfer.vllm: {where}: mamba_type {kind} is not supported "
                                 f"(Mamba2 and GDN are; Mamba1 has no vLLM CPU kernel to test)")
            if spec.num_speculative_blocks:
                raise ValueError(f"hxfer.vllm: {where}: speculative decoding "
                                 f"(num_speculative_blocks={spec.num_speculative_blocks}) is not "
                                 f"supported: its conv state has extra rows hxfer's model lacks")
            if len(spec.shapes) != 2:
                raise ValueError(f"hxfer.vllm: {where}: {len(spec.shapes)} states per page "
                                 f"(ReplaySSM?) are not supported; expected conv and ssm")
            if role_is_consumer and spec.mamba_cache_mode != "none":
                raise ValueError(
                    f"hxfer.vllm: the decode instance runs mamba_cache_mode="
                    f"{spec.mamba_cache_mode!r} (prefix caching on), which this connector does "
                    f"not support: a Mamba state block per position would have to be paired "
                    f"with P's; start the decode instance with --no-enable-prefix-caching "
                    f"(enable_prefix_caching=False)")
            groups.append(_Group(i, "mamba", spec, tuple(g.layer_names), state_group=mamba))
            mamba += 1
        else:
            raise ValueError(f"hxfer.vllm: {where} is not supported (full attention and "
                             f"Mamba2/GDN groups are)")
    if sum(g.kind == "attention" for g in groups) > 1:
        raise ValueError("hxfer.vllm: the attention layers form more than one KV cache group; "
                         "hxfer takes one block list per request")
    return groups


def _model_config_path(vllm_config, explicit: str | None) -> str:
    """The served model's config.json, which hxfer reads the layer shapes from."""
    mc = vllm_config.model_config
    candidates = [explicit] if explicit else [getattr(mc, "hf_config_path", None), mc.model]
    for c in candidates:
        if not c:
            continue
        if os.path.isdir(c) and os.path.isfile(os.path.join(c, "config.json")):
            return os.path.join(c, "config.json")
        if os.path.isfile(c):
            return c
    if not explicit:
        try:  # a hub id: the config.json vLLM already has in the Hugging Face cache
            from huggingface_hub import try_to_load_from_cache
            p = try_to_load_from_cache(mc.model, "config.json", revision=mc.revision)
            if isinstance(p, str):
                return p
        except Exception:  # noqa: BLE001  (no hub library, or an offline cache miss)
            pass
    raise ValueError(f"hxfer.vllm: cannot find the config.json of model {mc.model!r} "
                     f"(tried {candidates}); set kv_connector_extra_config['model_config']")


# ---------------------------------------------------------------------------------------------
# Describing vLLM's cache to hxfer


@dataclass
class CacheDescription:
    pools: dict[str, torch.Tensor]  # pool name -> an int8 tensor over the whole allocation
    records: list[dict]
    tokens_per_block: int
    num_blocks: int
    dtypes: dict[str, str | None]  # kv_dtype, conv_dtype, ssm_dtype
    state_groups: int
    joint_ids: bool


def _attention_records(layer, view, spec, isa, pool, base):
    """The K and V records of one CPU-backend attention view [blocks, heads, tokens, 2 x dim].

    vLLM's CPU backend (cpu_attn.py) reads a (block, head) as its first tokens*dim elements (K)
    then the next tokens*dim (V), `kv_cache.view(B, H, 2T, D).chunk(2, dim=2)`, in the order of
    its ISA's reshape_and_cache: 'vec'/'vec16' K transposed [dim][token], V [token][dim]; 'amx'
    K [token/16][dim/2][token%16][dim%2], V [dim/16][token/2][dim%16][token%2]."""
    B, H, T, C = view.shape
    D = spec.head_size
    if C != 2 * D or T != spec.block_size or view.dtype != spec.dtype:
        raise ValueError(f"hxfer.vllm: attention view of layer {layer} is {list(view.shape)} "
                         f"{view.dtype}, the spec says [blocks, {spec.num_kv_heads}, "
                         f"{spec.block_size}, {2 * D}] {spec.dtype}")
    if view.stride()[1:] != (T * C, C, 1):
        raise ValueError(f"hxfer.vllm: attention view of layer {layer} has strides "
                         f"{view.stride()}: the CPU backend needs each block's heads dense")
    k, v = view.view(B, H, 2 * T, D).chunk(2, dim=2)  # as cpu_attn.py splits them
    if isa in ("vec", "vec16"):
        return [tensor_record(layer, "kv", k.view(B, H, D, T), pool, base,
                              ["head", "dim", "token"], section="K"),
                tensor_record(layer, "kv", v, pool, base, ["head", "token", "dim"], section="V")]
    if isa == "amx":
        if T % 16 or D % 16:
            raise ValueError(f"hxfer.vllm: layer {layer}: ISA 'amx' with block_size={T}, "
                             f"head_size={D}: expected multiples of 16")
        return [tensor_record(layer, "kv", k.view(B, H, T // 16, D // 2, 16, 2), pool, base,
                              ["head", "token", "dim", "token", "dim"], section="K"),
                tensor_record(layer, "kv", v.view(B, H, D // 16, T // 2, 16, 2), pool, base,
                              ["head", "dim", "token", "dim", "token"], section="V")]
    raise ValueError(f"hxfer.vllm: layer {layer}: vLLM's CPU attention ISA {isa!r} is not "
                     f"described (described: {', '.join(_CPU_ISAS)}); its K/V order per head "
                     f"differs")


def _mamba_records(layer, view, spec, state_group, conv_dim_first, pool, base):
    """The conv and ssm records of one Mamba/GDN view [blocks, 1, 1, state bytes] (int8): the page
    holds conv then ssm, each row-major in the spec's shape and dtype (mamba/abstract.py
    bind_kv_cache); conv is (dim, window) under DS, (window, dim) under SD."""
    conv_shape, ssm_shape = spec.shapes
    conv_dt, ssm_dt = spec.dtypes
    conv_es = torch.empty((), dtype=conv_dt).element_size()
    ssm_es = torch.empty((), dtype=ssm_dt).element_size()
    conv_bytes = math.prod(conv_shape) * conv_es
    want = conv_bytes + math.prod(ssm_shape) * ssm_es
    if view.dtype != torch.int8 or view.dim() != 4 or tuple(view.shape[1:]) != (1, 1, want):
        raise ValueError(f"hxfer.vllm: Mamba view of layer {layer} is {list(view.shape)} "
                         f"{view.dtype}, expected [blocks, 1, 1, {want}] int8 (conv {conv_shape} "
                         f"{conv_dt} + ssm {ssm_shape} {ssm_dt})")
    offset, stride = view.data_ptr() - base, view.stride(0)
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    ssm_names = ["head", "value", "key"] if kind == "GDN_ATTN" else ["head", "head_dim", "state"]
    conv_names = ["channel", "window"] if conv_dim_first else ["window", "channel"]
    return [contiguous_record(layer, "conv", pool, offset, stride, conv_shape, conv_names, conv_es,
                              state_group=state_group),
            contiguous_record(layer, "ssm", pool, offset + conv_bytes, stride, ssm_shape,
                              ssm_names, ssm_es, state_group=state_group)]


def describe_cache(kv_caches: dict[str, torch.Tensor], groups: list[_Group], isa_of,
                   conv_dim_first: bool) -> CacheDescription:
    """hxfer's records of the tensors vLLM registered (register_kv_caches): one pool per backing
    storage, the attention and Mamba views of `groups` read as vLLM's code lays them out.
    `isa_of(layer_name)` gives the CPU attention ISA of an attention layer (layer.isa)."""
    pools: dict[int, tuple[str, torch.Tensor]] = {}  # storage data_ptr -> (name, tensor)

    def pool_of(view):
        st = view.untyped_storage()
        if st.data_ptr() not in pools:
            if view.device.type != "cpu":
                raise ValueError(f"hxfer.vllm: the KV cache is on {view.device}; this "
                                 f"connector serves vLLM's CPU backend (device pools move "
                                 f"through hxfer's API, not yet through the connector)")
            whole = torch.empty(0, dtype=torch.int8).set_(st, 0, (st.nbytes(),))
            pools[st.data_ptr()] = (f"kv{len(pools)}" if pools else "kv", whole)
        return pools[st.data_ptr()][0], st.data_ptr()

    records, kv_dtype, conv_dtype, ssm_dtype, tokens = [], None, None, None, None
    num_blocks = None
    for g in groups:
        for name in g.layer_names:
            view = kv_caches.get(name)
            if not isinstance(view, torch.Tensor):
                raise ValueError(f"hxfer.vllm: layer {name!r} of KV cache group {g.index} has no "
                                 f"tensor in register_kv_caches ({type(view).__name__})")
            if num_blocks is None:
                num_blocks = view.shape[0]
            elif view.shape[0] != num_blocks:
                raise ValueError(f"hxfer.vllm: layer {name!r} has {view.shape[0]} blocks, others "
                                 f"{num_blocks} (kernel block splitting is not supported)")
            pool, base = pool_of(view)
            layer = _layer_index(name)
            if g.kind == "attention":
                records += _attention_records(layer, view, g.spec, isa_of(name), pool, base)
                kv_dtype = _hxfer_dtype(g.spec.dtype, "attention")
                tokens = g.spec.block_size
            else:
                records += _mamba_records(layer, view, g.spec, g.state_group, conv_dim_first,
                                          pool, base)
                c, s = (_hxfer_dtype(d, w) for d, w in zip(g.spec.dtypes, ("conv", "ssm")))
                if (conv_dtype or c, ssm_dtype or s) != (c, s):
                    raise ValueError(f"hxfer.vllm: Mamba groups keep their states in different "
                                     f"dtypes ({conv_dtype}/{ssm_dtype} and {c}/{s})")
                conv_dtype, ssm_dtype = c, s
    n_state = sum(g.kind == "mamba" for g in groups)
    return CacheDescription(
        pools={name: t for name, t in pools.values()}, records=records,
        tokens_per_block=tokens or 32, num_blocks=num_blocks or 0,
        dtypes={"kv_dtype": kv_dtype, "conv_dtype": conv_dtype, "ssm_dtype": ssm_dtype},
        state_groups=max(n_state, 1), joint_ids=n_state > 0)


# ---------------------------------------------------------------------------------------------
# What travels between the two sides of vLLM (scheduler -> worker, worker -> scheduler)


@dataclass
class _SendReq:  # P: pages to mark ready in the Sender
    hxfer_id: int
    blocks: list[int]
    slot: int | None
    group_slots: list[int]


@dataclass
class _RecvReq:  # D: a load to start in the Receiver for P's instance
    hxfer_id: int
    remote_engine_id: str
    peers: tuple[str, ...]
    peer_tp: int
    num_tokens: int
    prefix_tokens: int
    blocks: list[int]
    slot: int | None
    group_slots: list[int]
    group_blocks: dict[int, list[int]]  # vLLM group id -> D's blocks loaded (for the controls)
    failed: str | None = None  # set: not started, reported failed (vLLM waits for it anyway)


class HxferConnectorMetadata(KVConnectorMetadata):
    def __init__(self):
        self.reqs_to_send: dict[str, _SendReq] = {}
        self.reqs_to_recv: dict[str, _RecvReq] = {}
        self.reqs_to_cancel: set[str] = set()


@dataclass
class HxferHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One worker's Sender address, collected by the scheduler at startup."""
    address: str | None
    routing: str | None = None


@dataclass
class HxferKVConnectorStats(KVConnectorStats):
    """Per-request transfer times and bytes (D: hxfer's Result.latency - Result.queued, from
    the load's first ask to its last byte landed; a wait for the first connection to the
    prefill instance is counted apart as connect time) and failures, lease expiries (P).
    Logged as vLLM's "KV Transfer metrics" line with the keys NIXL's uses."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {"transfer_duration": [], "bytes_transferred": [], "connect_duration": [],
                     "num_failed_transfers": 0, "num_kv_expired_reqs": 0}

    def record(self, seconds: float, nbytes: int):
        self.data["transfer_duration"].append(seconds)
        self.data["bytes_transferred"].append(nbytes)

    def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
        if other is not None and not other.is_empty():
            for k in ("transfer_duration", "bytes_transferred", "connect_duration"):
                self.data[k] += list(other.data.get(k, ()))
            for k in ("num_failed_transfers", "num_kv_expired_reqs"):
                self.data[k] += other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        # "MB" as NixlConnector's stats compute it (bytes / 2**20), so the lines compare.
        t = self.data["transfer_duration"]
        b = [x / 2**20 for x in self.data["bytes_transferred"]]
        n = len(t)
        out = {"Num successful transfers": n,
               "Avg xfer time (ms)": round(1e3 * sum(t) / n, 3) if n else 0.0,
               "P90 xfer time (ms)": round(1e3 * sorted(t)[min(n - 1, int(0.9 * n))], 3)
               if n else 0.0,
               "Avg MB per transfer": round(sum(b) / n, 3) if n else 0.0,
               "Throughput (MB/s)": round(sum(b) / sum(t), 3) if n and sum(t) else 0.0,
               "Num failed transfers": self.data["num_failed_transfers"],
               "Num KV expired reqs": self.data["num_kv_expired_reqs"]}
        c = self.data["connect_duration"]
        if c:  # connection setup to a prefill instance, not counted in the xfer times
            out["Num connects"] = len(c)
            out["Avg connect time (ms)"] = round(1e3 * sum(c) / len(c), 3)
        return out

    def is_empty(self) -> bool:
        return not (self.data["transfer_duration"] or self.data["num_failed_transfers"]
                    or self.data["num_kv_expired_reqs"] or self.data["connect_duration"])

    def clone_and_reset(self) -> "HxferKVConnectorStats":
        old = HxferKVConnectorStats(data=self.data)
        self.reset()
        return old


class HxferPromMetrics(KVConnectorPromMetrics):
    """The same figures on vLLM's Prometheus endpoint (`/metrics` of the API server), named as
    NixlConnector names its own (`vllm:nixl_*`): every transfer is counted there, where the log
    line of an idle interval is logged at debug level only."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        seconds = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0]

        def per_engine(cls, name, doc, **kw):
            m = cls(name=name, documentation=doc, labelnames=labelnames, **kw)
            return {i: m.labels(*v) for i, v in per_engine_labelvalues.items()}

        self.xfer_time = per_engine(
            self._histogram_cls, "vllm:hxfer_xfer_time_seconds",
            "Per loaded request: hxfer's transfer time, from the load's first ask to the prefill "
            "instance to its last byte landed (Result latency - queued).", buckets=seconds)
        self.bytes = per_engine(
            self._histogram_cls, "vllm:hxfer_bytes_transferred",
            "Bytes moved per loaded request.", buckets=[2.0 ** k for k in range(11, 35, 2)])
        self.connect_time = per_engine(
            self._histogram_cls, "vllm:hxfer_connect_time_seconds",
            "Connection setup to a prefill instance (not in the transfer times).",
            buckets=seconds)
        self.failed = per_engine(
            self._counter_cls, "vllm:hxfer_num_failed_transfers",
            "Loads that failed (the request is computed by this instance or failed, as "
            "kv_load_failure_policy says).")
        self.expired = per_engine(
            self._counter_cls, "vllm:hxfer_num_kv_expired_reqs",
            "Requests whose pages the prefill instance released at their lease before every "
            "decode rank asked for them (counted on the prefill instance).")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        d = transfer_stats_data
        for metric, key in ((self.xfer_time, "transfer_duration"),
                            (self.bytes, "bytes_transferred"),
                            (self.connect_time, "connect_duration")):
            for v in d.get(key, ()):
                metric[engine_idx].observe(v)
        for metric, key in ((self.failed, "num_failed_transfers"),
                            (self.expired, "num_kv_expired_reqs")):
            if d.get(key, 0):
                metric[engine_idx].inc(d[key])


# ---------------------------------------------------------------------------------------------
# Scheduler side (EngineCore process)


class _Scheduler:
    def __init__(self, vllm_config, kv_cache_config, groups: list[_Group], opts: _Options):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.groups = groups
        self.opts = opts
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.has_mamba = any(g.kind == "mamba" for g in groups)
        self.attn = next((g for g in groups if g.kind == "attention"), None)
        self.addresses: list[str] = []  # P's Senders by TP rank (set_xfer_handshake_metadata)
        self._to_send: dict[str, _SendReq] = {}
        self._to_recv: dict[str, _RecvReq] = {}
        self._to_cancel: set[str] = set()
        self._loading: set[str] = set()  # D: requests whose load is in flight

    # -- handshake: every worker's Sender address, once at startup
    def set_addresses(self, metadata: dict[int, Any]):
        addrs = [metadata[r].address for r in sorted(metadata)]
        if addrs and all(addrs):
            self.addresses = addrs
            logger.info("hxfer: this instance's Senders: %s (%s)", addrs,
                        metadata[min(metadata)].routing)

    # -- P: drop the last prompt token of a hybrid; D recomputes it from P's state
    def on_new_request(self, request):
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_decode")) or not self.has_mamba:
            return
        if (params.get("_p_side_truncated") or request.num_prompt_tokens <= 1
                or request.get_skip_reading_prefix_cache()):
            return
        if request.prompt_token_ids is not None:
            del request.prompt_token_ids[-1:]
        elif request.prompt_embeds is not None:
            request.prompt_embeds = request.prompt_embeds[:-1]
        else:
            return
        del request._all_token_ids[-1:]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_p_side_truncated"] = True

    def _load_count(self, request) -> int:
        """D: the prompt tokens P computed (N-1 for a hybrid, N otherwise)."""
        n = len(request.prompt_token_ids or [])
        return n - 1 if self.has_mamba and n > 1 else n

    @staticmethod
    def _remote_problem(params) -> str | None:
        """Why P's kv_transfer_params cannot start a load, or None. They arrive in the client's
        request body (served mode): anything may be in them, and nothing of it may raise in the
        engine."""
        peers, rid = params.get("hxfer_peers"), params.get("hxfer_request_id")
        if not peers or not isinstance(peers, list) or not all(
                isinstance(p, str) and p for p in peers):
            return f"hxfer_peers={peers!r} (expected P's Sender addresses, strings)"
        if isinstance(rid, bool) or not isinstance(rid, int) or not 0 < rid < 2**63:
            return f"hxfer_request_id={rid!r} (expected an integer in 1..2^63-1)"
        for k in ("remote_num_tokens", "tp_size"):
            v = params.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                return f"{k}={v!r} (expected a count)"
        if params.get("tp_size") not in (None, 0) and params["tp_size"] != len(peers):
            return f"tp_size={params['tp_size']} with {len(peers)} hxfer_peers"
        return None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_prefill")):
            return 0, False
        problem = self._remote_problem(params)
        if problem is not None:
            logger.warning("hxfer: request %s has do_remote_prefill, but its kv_transfer_params "
                           "cannot start a load (%s; params of another connector?): computing it "
                           "here", request.request_id, problem)
            return 0, False
        want, remote = self._load_count(request), params.get("remote_num_tokens")
        if self.has_mamba and remote != want:
            # The moved state is h(remote); this instance would resume from h(want).
            logger.warning("hxfer: request %s: P computed %s tokens, a hybrid needs exactly %d "
                           "(N-1): computing it here", request.request_id, remote, want)
            return 0, False
        count = min(want, remote if remote is not None else want) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_prefill")):
            return
        params["do_remote_prefill"] = False  # one load per request
        if num_external_tokens <= 0 or self._remote_problem(params) is not None:
            return  # a local hit covers it; P's pages go at its lease
        want = min(self._load_count(request), params.get("remote_num_tokens") or 1 << 62)
        all_ids = blocks.get_block_ids()
        unhashed = blocks.get_unhashed_block_ids_all_groups()
        group_blocks: dict[int, list[int]] = {}
        attn, slots = [], []
        for g in self.groups:
            if g.kind == "attention":
                attn = list(all_ids[g.index][:_cdiv(want, g.spec.block_size)])
                group_blocks[g.index] = attn
            else:
                ids = clip_ssm_state_blocks(list(unhashed[g.index]), g.spec.num_speculative_blocks)
                if not ids:
                    # vLLM already waits for this load (load_kv_async): it must end, failed, or
                    # the request and its blocks wait forever.
                    failed = (f"no state block in KV cache group {g.index} among the request's "
                              f"new blocks")
                    break
                slots.append(ids[-1])
                group_blocks[g.index] = [ids[-1]]
        else:
            failed = None
        self._to_recv[request.request_id] = _RecvReq(
            hxfer_id=int(params["hxfer_request_id"]),
            remote_engine_id=str(params.get("remote_engine_id")),
            peers=tuple(params["hxfer_peers"]), peer_tp=int(params.get("tp_size") or 0),
            num_tokens=want, prefix_tokens=want - num_external_tokens, blocks=attn,
            slot=slots[0] if slots else None, group_slots=slots[1:], group_blocks=group_blocks,
            failed=failed)
        self._loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output) -> HxferConnectorMetadata:
        meta = HxferConnectorMetadata()
        meta.reqs_to_send, self._to_send = self._to_send, {}
        meta.reqs_to_recv, self._to_recv = self._to_recv, {}
        meta.reqs_to_cancel, self._to_cancel = self._to_cancel, set()
        return meta

    def update_connector_output(self, output):
        for rid in output.finished_recving or ():
            self._loading.discard(rid)

    def request_finished(self, request, block_ids: tuple[list[int], ...]):
        params = request.kv_transfer_params
        rid = request.request_id
        if rid in self._loading:  # D: aborted while its load runs; vLLM waits for the end
            self._to_cancel.add(rid)  # the worker started it already (same schedule() call)
            return False, None
        if not (params and params.get("do_remote_decode")):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted prefill: nothing to hand over
        if not self.addresses:
            logger.error("hxfer: request %s finished on a prefill instance without Senders "
                         "(kv_role %s): its blocks are freed, the decode instance computes it",
                         rid, self.vllm_config.kv_transfer_config.kv_role)
            return False, None
        if self.has_mamba and not params.get("_p_side_truncated"):
            logger.warning("hxfer: request %s was not cut at N-1 (prompt logprobs?): no handover",
                           rid)
            return False, None
        num_tokens = request.num_computed_tokens
        clipped = self._clip(block_ids, num_tokens)
        if not any(clipped.values()):
            return False, None
        attn = clipped[self.attn.index] if self.attn else []
        slots = [clipped[g.index][0] for g in self.groups if g.kind == "mamba"]
        hxfer_id = secrets.randbits(53) or 1  # below 2^53: exact as a JSON number everywhere
        self._to_send[rid] = _SendReq(hxfer_id, attn, slots[0] if slots else None, slots[1:])
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_block_ids": [clipped[g.index] for g in self.groups],
            "remote_num_tokens": num_tokens,
            "tp_size": self.tp_size,
            "hxfer_peers": list(self.addresses),
            "hxfer_request_id": hxfer_id,
            "transfer_mode": "hxfer",
        }

    def _clip(self, block_ids, num_tokens) -> dict[int, list[int]]:
        """P's blocks per group, clipped as vLLM's NIXL path does: the attention blocks of the
        computed tokens; per Mamba group the state-bearing block (clip_ssm_state_blocks)."""
        out = {}
        for g in self.groups:
            ids = [b for b in block_ids[g.index] if b != 0]  # 0: the null block
            if g.kind == "attention":
                out[g.index] = ids[:_cdiv(num_tokens, g.spec.block_size)]
            else:
                out[g.index] = clip_ssm_state_blocks(ids, g.spec.num_speculative_blocks)
        if any(not out[g.index] for g in self.groups if g.kind == "mamba"):
            return {g.index: [] for g in self.groups}
        return out


# ---------------------------------------------------------------------------------------------
# Worker side (one per TP rank)


@dataclass
class _Loading:
    req: _RecvReq
    rx: Any  # the Receiver, None when it took nothing
    failed: str | None = None  # why, once hxfer said so; reported after its release


class _Worker:
    def __init__(self, vllm_config, kv_cache_config, groups: list[_Group], opts: _Options):
        self.vllm_config = vllm_config
        self.groups = groups
        self.opts = opts
        role = vllm_config.kv_transfer_config.kv_role
        self.sends = role in ("kv_producer", "kv_both")
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.instance = opts.instance or f"vllm-{self.engine_id}"
        self.layout = None
        self.memory = None
        self.sender = None
        # (P's addresses, P's tp) -> (index, Receiver): one Receiver per P instance, kept across
        # P's restarts at the same addresses (it reconnects by itself), at most MAX_RECEIVERS.
        self.receivers: dict[tuple, tuple[int, Any]] = {}
        self._receivers_made = 0
        self._memory_taken = False  # the first Receiver (or the Sender) holds self.memory
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.stats = HxferKVConnectorStats()
        self._lock = threading.Lock()
        self._sent: dict[int, str] = {}  # P: hxfer id -> vLLM request id, pages in the Sender
        self._released_sends: set[str] = set()  # guarded by _lock
        self._loads: dict[str, _Loading] = {}  # D: vLLM request id -> load in flight
        self._cancelled: set[str] = set()  # D: loads cancelled by vLLM (an abort), not failures
        self._expired_seen = 0

    # -- registration
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
        self.kv_caches = kv_caches
        ctx = self.vllm_config.compilation_config.static_forward_context

        def isa_of(name):
            isa = getattr(ctx.get(name), "isa", None)
            if isa is None:
                raise ValueError(f"hxfer.vllm: attention layer {name!r} has no CPU ISA "
                                 f"(layer.isa): this connector describes vLLM's CPU attention "
                                 f"backend only")
            return isa

        d = describe_cache(kv_caches, self.groups, isa_of, is_conv_state_dim_first())
        tp = self.vllm_config.parallel_config.tensor_parallel_size
        tp_rank = get_tensor_model_parallel_rank()
        model = _model_config_path(self.vllm_config, self.opts.model_config)
        self.layout = hxfer.Layout.from_records(
            model=model, tp=tp, tp_rank=tp_rank, num_blocks=d.num_blocks,
            # State ids are block ids (joint ids); a model without state has none: hxfer
            # expects a slot per request whenever num_slots > 0.
            num_slots=d.num_blocks if d.joint_ids else 0, tokens_per_block=d.tokens_per_block,
            pools={n: t.numel() for n, t in d.pools.items()}, records=d.records,
            state_groups=d.state_groups, joint_ids=d.joint_ids, label="vllm-0.32-tensors",
            **{k: v for k, v in d.dtypes.items() if v is not None})
        self._pools = d.pools
        self.memory = hxfer.Memory(self.layout, dict(d.pools))
        logger.info("hxfer: registered %s (%d records, pools %s) from %s", self.layout.describe(),
                    len(d.records), {n: t.numel() for n, t in d.pools.items()}, model)
        if self.sends:
            port = self.opts.port + tp_rank if self.opts.port else 0
            self.sender = hxfer.Sender(
                self.layout, self.memory, listen=f"{self.opts.host}:{port}",
                backend=self.opts.backend, token=self.opts.token,
                instance=f"{self.instance}-prefill", checksum=self.opts.checksum,
                lease_timeout=self.opts.lease_timeout, stall_timeout=self.opts.stall_timeout,
                ucx_options=self.opts.ucx_options, on_released=self._on_send_released)
            logger.info("hxfer: Sender %s; %s", self.sender.address, self.sender.routing)

    def handshake_metadata(self):
        if self.sender is None:
            return None
        return HxferHandshakeMetadata(address=self.sender.address, routing=self.sender.routing)

    # -- P: pages ready, released by hxfer
    def _on_send_released(self, hxfer_id: int):  # an hxfer thread
        with self._lock:
            rid = self._sent.pop(hxfer_id, None)
            if rid is not None:
                self._released_sends.add(rid)

    def _mark_ready(self, rid: str, s: _SendReq):
        with self._lock:
            self._sent[s.hxfer_id] = rid
        try:
            self.sender.mark_ready(s.hxfer_id, blocks=s.blocks, slot=s.slot,
                                   group_slots=s.group_slots or None)
        except hxfer.Error as e:  # it took nothing: free the blocks now
            logger.error("hxfer: request %s: mark_ready(%d, blocks %s, slot %s, group slots %s) "
                         "failed: %s", rid, s.hxfer_id, s.blocks, s.slot, s.group_slots, e)
            with self._lock:
                self._sent.pop(s.hxfer_id, None)
                self._released_sends.add(rid)

    # -- D: loads
    def _receiver(self, r: _RecvReq) -> tuple[int, Any]:
        # By P's addresses, not its engine id: P restarted at the same addresses (a new engine
        # id) is the Receiver's own peers again, and two Receivers of one instance name towards
        # one P would each take the other's connection over, back and forth.
        key = (r.peers, r.peer_tp or len(r.peers))
        entry = self.receivers.get(key)
        if entry is None:
            self._make_room_for_a_receiver(r)
            # One Receiver per P instance (its peers are fixed); each needs a Memory of its own
            # over the same buffer (a Memory serves one Sender or Receiver at a time).
            # (kv_both: the Sender holds the first one.)
            if self.sender is None and not self._memory_taken:
                memory = self.memory
            else:
                memory = hxfer.Memory(self.layout, dict(self._pools))
            self._memory_taken = True
            index = self._receivers_made
            self._receivers_made += 1
            rx = hxfer.Receiver(
                self.layout, memory, peers=list(r.peers), peer_tp=r.peer_tp or len(r.peers),
                backend=self.opts.backend, token=self.opts.token,
                instance=f"{self.instance}-decode", checksum=self.opts.checksum,
                request_timeout=self.opts.request_timeout,
                handshake_timeout=self.opts.handshake_timeout, ucx_options=self.opts.ucx_options)
            entry = self.receivers[key] = (index, rx)
            logger.info("hxfer: Receiver for prefill instance %s at %s; %s", r.remote_engine_id,
                        list(r.peers), rx.routing)
            # Connect now, off the engine's thread: loads started meanwhile are queued by hxfer
            # until the handshake completed; that wait is connect time, not transfer time.
            threading.Thread(target=self._connect, args=(index, rx, list(r.peers)), daemon=True,
                             name=f"hxfer-connect-{index}").start()
        return entry

    def _make_room_for_a_receiver(self, r: _RecvReq):
        """Below MAX_RECEIVERS Receivers: shuts down the oldest with no load in flight (each
        holds a staging region, the pools' registration and threads, and the addresses come
        from requests). Raises when every one is busy."""
        while len(self.receivers) >= MAX_RECEIVERS:
            busy = {id(load.rx) for load in self._loads.values() if load.rx is not None}
            idle = next((k for k, (_, rx) in self.receivers.items() if id(rx) not in busy), None)
            if idle is None:
                raise RuntimeError(f"{len(self.receivers)} prefill instances have loads in "
                                   f"flight (at most {MAX_RECEIVERS} at once); "
                                   f"{list(r.peers)} is one more")
            _, rx = self.receivers.pop(idle)
            logger.info("hxfer: closing the idle Receiver for %s (at most %d prefill "
                        "instances)", list(idle[0]), MAX_RECEIVERS)
            try:
                rx.shutdown()
            except hxfer.Error as e:
                logger.warning("hxfer: shutdown of the Receiver for %s: %s", list(idle[0]), e)

    def _connect(self, index: int, rx, peers: list[str]):
        t0 = time.monotonic()
        try:
            rx.wait_for_peers(self.opts.handshake_timeout)
        except hxfer.Error as e:
            logger.warning("hxfer: connecting to %s: %s (loads from it fail)", peers, e)
            return
        t1 = time.monotonic()
        with self._lock:
            self.stats.data["connect_duration"].append(t1 - t0)
        logger.info("hxfer: connected to %s in %.1f ms", peers, 1e3 * (t1 - t0))

    def _start(self, rid: str, r: _RecvReq):
        if r.failed is not None:  # the scheduler could not describe it: nothing to start
            self._loads[rid] = _Loading(r, None, failed=r.failed)
            return
        try:
            _, rx = self._receiver(r)
        except Exception as e:  # noqa: BLE001  hxfer.Error, or a TypeError on hostile params
            self._loads[rid] = _Loading(r, None, failed=f"no Receiver for {list(r.peers)}: {e}")
            return
        load = _Loading(r, rx)
        self._loads[rid] = load
        try:
            rx.start(r.hxfer_id, num_tokens=r.num_tokens, blocks=r.blocks, slot=r.slot,
                     prefix_tokens=r.prefix_tokens, group_slots=r.group_slots or None)
        except Exception as e:  # noqa: BLE001  hxfer.Error, or pybind refusing an argument
            load.failed = f"start: {e}"
            # Refused before taking the pages (a bad argument, a context rank down or refused),
            # or failed after and already freed them: nothing of this load is fenced.
            if not rx.holds(r.hxfer_id):
                load.rx = None

    @staticmethod
    def _released(load: _Loading) -> bool:
        """Whether hxfer no longer fences the load's pages: no write of P can land in them."""
        return load.rx is None or not load.rx.holds(load.req.hxfer_id)

    def _poll_loads(self, done: set[str], failed: set[str]):
        for rid, load in list(self._loads.items()):
            if load.failed is None:
                r = load.rx.poll(load.req.hxfer_id)
                if not r.terminal:
                    continue
                if r.ok:
                    load.rx.release(load.req.hxfer_id)  # the pages are vLLM's again
                    with self._lock:
                        # hxfer's own clock: the wait for the first connection (connect time,
                        # counted apart) is not transfer time.
                        self.stats.record(max(r.latency - r.queued, 0.0), r.bytes)
                    if self.opts.corrupt:
                        self._corrupt(rid, load.req)
                    del self._loads[rid]
                    self._cancelled.discard(rid)
                    done.add(rid)
                    continue
                load.failed = f"{r.code}: {r.message}"
            # A failed load is reported once hxfer released its pages: no write of P can still
            # land in blocks vLLM is about to free.
            if self._released(load):
                if rid in self._cancelled:  # vLLM aborted it: not a failed transfer
                    logger.info("hxfer: load of request %s (hxfer id %d) cancelled: %s", rid,
                                load.req.hxfer_id, load.failed)
                else:
                    logger.error("hxfer: loading request %s (hxfer id %d) from %s failed: %s",
                                 rid, load.req.hxfer_id, list(load.req.peers), load.failed)
                    with self._lock:
                        self.stats.data["num_failed_transfers"] += 1
                self._cancelled.discard(rid)
                if load.rx is not None:
                    try:
                        load.rx.release(load.req.hxfer_id)  # forgets the result
                    except hxfer.Error:
                        pass
                del self._loads[rid]
                done.add(rid)
                failed.add(rid)

    def _cancel(self, rid: str):
        load = self._loads.get(rid)
        if load is not None and load.failed is None and load.rx is not None:
            self._cancelled.add(rid)
            try:
                load.rx.cancel(load.req.hxfer_id)
            except hxfer.Error as e:
                logger.debug("hxfer: cancel of %s: %s", rid, e)

    # -- the step's hooks
    def start_load_kv(self, meta: HxferConnectorMetadata):
        for rid, s in meta.reqs_to_send.items():
            self._mark_ready(rid, s)
        for rid, r in meta.reqs_to_recv.items():
            self._start(rid, r)
        for rid in meta.reqs_to_cancel:
            self._cancel(rid)

    def transfer_results(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self._loads:
            self._poll_loads(out.finished_recving, out.failed_recving)
        with self._lock:
            if self._released_sends:
                out.finished_sending, self._released_sends = self._released_sends, set()
        if out.finished_sending and self.sender is not None:
            expired = int(self.sender.metrics().get("leases_expired", 0))
            if expired > self._expired_seen:
                logger.warning("hxfer: %d request(s) released at their lease (%g s) before every "
                               "decode rank asked for them", expired - self._expired_seen,
                               self.opts.lease_timeout)
                with self._lock:
                    self.stats.data["num_kv_expired_reqs"] += expired - self._expired_seen
                self._expired_seen = expired
        return out

    def connector_stats(self):
        with self._lock:  # the connect threads add to it
            return None if self.stats.is_empty() else self.stats.clone_and_reset()

    # -- negative controls (tests/vllm/README.md)
    def _corrupt(self, rid: str, r: _RecvReq):
        mode, layers, nbytes = self.opts.corrupt, 0, 0
        for g in self.groups:
            ids = r.group_blocks.get(g.index) or []
            if not ids:
                continue
            if g.kind == "mamba" and mode in ("mamba_page", "conv"):
                conv = (math.prod(g.spec.shapes[0])
                        * torch.empty((), dtype=g.spec.dtypes[0]).element_size())
                for name in g.layer_names:
                    page = self.kv_caches[name][ids[-1]].reshape(-1)  # the unpadded page, bytes
                    end = conv if mode == "conv" else page.numel()
                    page[:end].zero_()
                    layers, nbytes = layers + 1, nbytes + end
            elif g.kind == "attention" and mode == "kv_block":
                for name in g.layer_names:
                    kv = self.kv_caches[name][ids[0]]  # tokens [0, block_size): all heads, K, V
                    kv.zero_()
                    layers, nbytes = layers + 1, nbytes + kv.numel() * kv.element_size()
        logger.info("%s=%s applied: request=%s layers=%d bytes=%d", CORRUPT_KEY, mode, rid,
                    layers, nbytes)

    def shutdown(self):
        for obj in [self.sender, *(rx for _, rx in self.receivers.values())]:
            if obj is not None:
                try:
                    obj.shutdown()
                except hxfer.Error as e:
                    logger.warning("hxfer: shutdown: %s", e)
        self.receivers.clear()


# ---------------------------------------------------------------------------------------------
# The connector


class HxferConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over hxfer: P/D disaggregation for attention and hybrid (Mamba2, GDN)
    models on vLLM's CPU backend. See the module docstring and docs/vllm.md."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self._opts = _Options.parse(dict(tc.kv_connector_extra_config or {}))
        if tc.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"hxfer.vllm: kv_role={tc.kv_role!r}: expected kv_producer, "
                             f"kv_consumer or kv_both")
        groups = _groups_of(vllm_config, kv_cache_config, tc.kv_role != "kv_producer")
        logger.info("hxfer %s connector, %s, %s side, on vLLM %s: groups %s", hxfer.__version__,
                    tc.kv_role, role.name.lower(), getattr(vllm, "__version__", "?"),
                    [(g.index, g.kind, len(g.layer_names)) for g in groups])
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _Scheduler(vllm_config, kv_cache_config, groups, self._opts)
        else:
            self._worker = _Worker(vllm_config, kv_cache_config, groups, self._opts)

    # ---- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._scheduler.build_connector_meta(scheduler_output)

    def on_new_request(self, request):
        self._scheduler.on_new_request(request)

    def update_connector_output(self, connector_output):
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids):
        return self._scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request):
        # The load writes every group's blocks of the request: none of them is to be zeroed.
        return self._kv_cache_config.transfer_group_ids

    def set_xfer_handshake_metadata(self, metadata):
        self._scheduler.set_addresses(metadata)

    # ---- worker side
    def register_kv_caches(self, kv_caches):
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self):
        return self._worker.handshake_metadata()

    def start_load_kv(self, forward_context, **kwargs):
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name):
        pass  # loads are asynchronous and complete before the request is scheduled

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass  # P's pages are read where they lie, after the request finished

    def wait_for_save(self):
        pass

    def get_transfer_results(self, finished_req_ids):
        return self._worker.transfer_results()

    def get_finished(self, finished_req_ids):
        # It cannot say that a load failed: a caller would decode from pages never written.
        raise NotImplementedError("hxfer.vllm reports transfers through get_transfer_results "
                                  "(failed loads included); vLLM 0.32 calls only that")

    def get_kv_connector_stats(self):
        return self._worker.connector_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return HxferKVConnectorStats(data=data) if data is not None else HxferKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return HxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
