"""SGLang's side of the HiCache backend tests: the host pool a backend touches, page keys, the
factory call that builds a backend, and synthetic producer pages."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from scd_store.adapters.sglang.backend import ScdHiCacheStorage
from scd_store.adapters.sglang.pages import flat_page
from scd_store.codecs.kv_state import KVState
from tests.bundles import LAYOUT, correlated_state

PAGE, PAGES = 8, 4
L, H, D = LAYOUT.num_layers, LAYOUT.kv_heads, LAYOUT.head_dim


class HostPool:
    """The part of SGLang's MHA host pool a storage backend touches (its real class needs torchvision to
    import here): a ``[2, layers, tokens, heads, dim]`` (layer_first) or ``[2, tokens, layers, heads, dim]``
    (page_first) buffer and the page accessors with SGLang's shapes."""

    def __init__(self, layout: str, tokens: int = 64, dtype=torch.float16) -> None:
        self.layout, self.page_size, self.dtype = layout, PAGE, dtype
        self.layer_num, self.head_num, self.head_dim = L, H, D
        dims = (2, L, tokens, H, D) if layout == "layer_first" else (2, tokens, L, H, D)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = (self.kv_buffer[:, :, index:index + PAGE] if self.layout == "layer_first"
                else self.kv_buffer[:, index:index + PAGE])
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + PAGE] = data_page.reshape(2, L, PAGE, H, D)
        else:
            self.kv_buffer[:, index:index + PAGE] = data_page.reshape(2, PAGE, L, H, D)

    def state_tokens(self, index: int) -> torch.Tensor:
        """``[2, L, H, PAGE, D]`` of the page at ``index`` (layout-independent view for checks)."""
        page = self.get_data_page(index, flat=False)
        return page.permute(0, 1, 3, 2, 4) if self.layout == "layer_first" else page.permute(0, 2, 3, 1, 4)


def page_keys(n: int) -> list[str]:
    """The storage keys SGLang's HiRadixCache gives ``n`` pages of a prompt (no namespace), by its own hash."""
    return get_hash_str(list(range(n * PAGE)), None, page_size=PAGE)


def make_backend(model: str, bundle, store_yaml, prefix_keys: bool | None = True, **scd) -> ScdHiCacheStorage:
    extra = {"backend_name": "scd", "module_path": "scd_store.adapters.sglang.backend",
             "class_name": "ScdHiCacheStorage", "interface_v1": 1,
             "scd": {"bundles": [str(bundle)], "store_config": str(store_yaml), **scd}}
    if prefix_keys is not None:
        extra["hicache_storage_pass_prefix_keys"] = prefix_keys
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name=model, extra_config=extra)
    return StorageBackendFactory.create_backend("dynamic", config, None)


def producer_kv(seed: int = 3) -> torch.Tensor:
    """A synthetic prompt's producer KV, PAGES pages, ``[2, L, H, T, D]`` fp16."""
    state = correlated_state(PAGES * PAGE, seed=seed)
    return torch.stack([state.keys, state.values]).half()


def fill_producer(pool: HostPool, host_base: int, seed: int = 3, pages: int = PAGES, first_page: int = 0
                  ) -> torch.Tensor:
    """Write ``pages`` pages of the prompt's producer KV, from page ``first_page`` on, at host indices from
    ``host_base``; return the whole prompt's KV ``[2, L, H, T, D]``."""
    kv = producer_kv(seed)
    for i in range(pages):
        p = first_page + i
        part = kv[:, :, :, p * PAGE:(p + 1) * PAGE]
        pool.set_from_flat_data_page(host_base + i * PAGE, flat_page(
            KVState(part[0].float(), part[1].float(), start=0), pool.layout, pool.dtype))
    return kv


