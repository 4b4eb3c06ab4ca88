"""Real LMCacheEngines on CPU with the scd-store plugin, over any GPU connector, for the unit tests; and the
tiny bundle's producer KV in LMCache's layout."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch
import yaml

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

from tests.bundles import LAYOUT, correlated_state, write_tiny_bundle  # noqa: E402

HEADS, DIM, LAYERS = LAYOUT.kv_heads, LAYOUT.head_dim, LAYOUT.num_layers


def plugin_config(bundle: Path, store_yaml: Path, chunk_size: int, **scd: object) -> LMCacheEngineConfig:
    """An LMCache config with the scd-store plugin (the documented keys)."""
    extra = {"storage_plugin.scd.module_path": "scd_store.adapters.lmcache.plugin",
             "storage_plugin.scd.class_name": "ScdStoragePlugin",
             "scd.bundles": str(bundle), "scd.store_config": str(store_yaml)}
    extra.update({f"scd.{k}": v for k, v in scd.items()})
    return LMCacheEngineConfig.from_defaults(chunk_size=chunk_size, local_cpu=True, max_local_cpu_size=0.05,
                                             storage_plugins=["scd"], extra_config=extra, save_unfull_chunk=True,
                                             pre_caching_hash_algorithm="sha256_cbor")


def write_store_yaml(path: Path, disk: Path) -> Path:
    path.write_text(yaml.safe_dump({"tiers": [{"kind": "cpu", "max_bytes": "64MiB"},
                                              {"kind": "disk", "path": str(disk), "max_bytes": "256MiB"}],
                                    "registry_path": str(disk.parent / "registry.json"),
                                    "stats_path": str(disk.parent / "stats")}))
    return path


def metadata(model: str, chunk_size: int, dtype: torch.dtype = torch.float16) -> LMCacheMetadata:
    """LMCache's metadata of an engine serving the tiny bundle's geometry."""
    return LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=dtype, kv_shape=(LAYERS, 2, chunk_size, HEADS, DIM))


def producer_kv(tokens: int, seed: int = 11) -> torch.Tensor:
    """KV the tiny space can code, ``[2, L, T, H*D]`` in fp16 (LMCache's ``KV_2LTD``)."""
    state = correlated_state(tokens, seed=seed)
    kv = torch.stack([state.keys, state.values]).permute(0, 1, 3, 2, 4)  # [2, L, T, H, D]
    return kv.reshape(2, LAYERS, tokens, HEADS * DIM).half().contiguous()


class Engines:
    """Builds post-initialised engines and destroys them at the end; ``bundle`` / ``store_yaml`` for their config."""

    def __init__(self, tmp_path: Path) -> None:
        self.bundle = tmp_path / "bundle"
        write_tiny_bundle(self.bundle, consumers=("consumer-a",))
        self.store_yaml = write_store_yaml(tmp_path / "store.yaml", tmp_path / "disk")
        self._instances: list[str] = []

    def config(self, chunk_size: int, **scd: object) -> LMCacheEngineConfig:
        return plugin_config(self.bundle, self.store_yaml, chunk_size, **scd)

    def start(self, model: str, config: LMCacheEngineConfig, connector: Any,
              dtype: torch.dtype = torch.float16) -> LMCacheEngine:
        instance = f"{model}-{uuid.uuid4().hex[:8]}"
        engine = LMCacheEngineBuilder.get_or_create(instance, config, metadata(model, config.chunk_size, dtype),
                                                    connector, None, None)
        self._instances.append(instance)
        engine.post_init()
        return engine

    def close(self) -> None:
        for instance in self._instances:
            LMCacheEngineBuilder.destroy(instance)


def scd_backend(engine: LMCacheEngine) -> Any:
    """The scd-store plugin inside an engine (None when LMCache failed to build it)."""
    return engine.storage_manager.storage_backends.get("scd")


def expected_consumer_kv(bundle: Path, consumer: str, kv: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """scd-store's own decode for ``consumer`` of ``kv``'s chunks coded at their true positions, in LMCache's
    layout and dtype (as the plugin decodes)."""
    from scd_store.adapters.lmcache.layout import kv_2ltd_views, state_from_kv_2ltd
    from scd_store.codecs.scd.bundle import load_pair, load_space
    from scd_store.codecs.scd.codec import ScdCodec

    space = load_space(bundle)
    codec = ScdCodec(space, load_pair(bundle, consumer, space))
    out = torch.zeros_like(kv)
    for start in range(0, kv.shape[2], chunk_size):
        end = min(start + chunk_size, kv.shape[2])
        payload = codec.encode(state_from_kv_2ltd(kv[:, :, start:end], HEADS, start))
        buffer = torch.empty(2, LAYERS, end - start, HEADS * DIM, dtype=kv.dtype)  # as the plugin's memory object
        codec.decode_into(payload, *kv_2ltd_views(buffer, HEADS))
        out[:, :, start:end] = buffer
    return out
