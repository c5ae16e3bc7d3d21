"""NixlConnector plus the negative-control hook of README.md: the reference implementation.

`kv_connector_extra_config["test_corrupt_after_load"]` on D zeroes part of what each request
loaded, after the load and before D's first forward reads it. hxfer's connector honors the
same key; this class shows the semantics on vLLM's own connector, so the controls are known
to be detectable with the fixture models before hxfer exists.

Loaded as kv_connector "CorruptingNixlConnector", kv_connector_module_path "corrupting_nixl"
(tests/vllm on PYTHONPATH). Worker-side only; the scheduler side is NIXL's, unchanged.
"""
import math

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

logger = init_logger("vllm.hxfer_test.corrupting_nixl")

KEY = "test_corrupt_after_load"
MODES = ("mamba_page", "conv", "kv_block")


class CorruptingNixlConnector(NixlConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self._mode = vllm_config.kv_transfer_config.get_from_extra_config(KEY, None)
        if self._mode is not None and self._mode not in MODES:
            raise ValueError(f"kv_connector_extra_config[{KEY!r}]={self._mode!r}: "
                             f"expected one of {MODES}")
        self._groups = kv_cache_config.kv_cache_groups
        self._caches: dict[str, torch.Tensor] = {}
        self._loading: dict[str, tuple[list[int], ...]] = {}  # request -> D's block ids

    def register_kv_caches(self, kv_caches):
        self._caches = kv_caches
        super().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        for req_id, meta in self._connector_metadata.reqs_to_recv.items():
            self._loading[req_id] = meta.local_block_ids
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids):
        results = super().get_transfer_results(finished_req_ids)
        for req_id in results.finished_recving - results.failed_recving:
            blocks = self._loading.pop(req_id, None)
            if blocks is not None and self._mode is not None:
                self._corrupt(req_id, blocks)
        return results

    def _corrupt(self, req_id, blocks):
        layers = nbytes = 0
        for group, ids in zip(self._groups, blocks):
            spec, ids = group.kv_cache_spec, [b for b in ids if b != 0]  # 0: the null block
            if not ids:
                continue
            if isinstance(spec, MambaSpec) and self._mode in ("mamba_page", "conv"):
                block = ids[-1]  # the state-bearing block (NIXL's clip_ssm_state_blocks)
                conv = math.prod(spec.shapes[0]) * torch.empty((), dtype=spec.dtypes[0]).element_size()
                for name in group.layer_names:
                    page = self._page(name, block)
                    end = conv if self._mode == "conv" else page.numel()
                    page[:end].zero_()
                    layers, nbytes = layers + 1, nbytes + end
            elif isinstance(spec, AttentionSpec) and self._mode == "kv_block":
                for name in group.layer_names:
                    kv = self._caches[name]
                    kv[ids[0]].zero_()  # the block of tokens [0, block_size), all heads, K and V
                    layers, nbytes = layers + 1, nbytes + kv[ids[0]].numel() * kv.element_size()
        logger.info("%s=%s applied: request=%s layers=%d bytes=%d", KEY, self._mode, req_id,
                    layers, nbytes)

    def _page(self, name, block):
        """The unpadded state page of one block of a Mamba layer, as bytes."""
        kv = self._caches[name]
        assert isinstance(kv, torch.Tensor) and kv.dtype == torch.int8, (name, type(kv))
        return kv[block].reshape(-1)
