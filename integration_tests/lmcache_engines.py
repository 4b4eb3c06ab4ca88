"""Real LMCacheEngines on CPU for the plugin tests, over scd-store's dense connector (``[2, L, T, H*D]``)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch
import yaml

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

from scd_store.adapters.lmcache.dense_connector import DenseKVConnector  # noqa: E402


class PositionlessConnector(DenseKVConnector):
    """Like LMCache's own connectors: moves chunks, records no positions."""

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        memory_obj.tensor.copy_(self.kv[:, :, start:end])


def plugin_config(bundles: list[Path], store_yaml: Path, chunk_size: int, **scd: object) -> LMCacheEngineConfig:
    """An LMCache config with the scd-store plugin (the documented keys)."""
    extra = {"storage_plugin.scd.module_path": "scd_store.adapters.lmcache.plugin",
             "storage_plugin.scd.class_name": "ScdStoragePlugin",
             "scd.bundles": ",".join(str(b) for b in bundles), "scd.store_config": str(store_yaml)}
    extra.update({f"scd.{k}": v for k, v in scd.items()})
    return LMCacheEngineConfig.from_defaults(chunk_size=chunk_size, local_cpu=True, max_local_cpu_size=0.05,
                                             storage_plugins=["scd"], extra_config=extra, save_unfull_chunk=True,
                                             pre_caching_hash_algorithm="sha256_cbor")  # never "builtin": refused


def write_store_yaml(path: Path, disk: Path) -> Path:
    path.write_text(yaml.safe_dump({"tiers": [{"kind": "cpu", "max_bytes": "64MiB"},
                                              {"kind": "disk", "path": str(disk), "max_bytes": "256MiB"}],
                                    "registry_path": str(disk.parent / "registry.json"),  # outside the tier
                                    "stats_path": str(disk.parent / "stats")}))
    return path


def tiny_deployment(tmp_path: Path, consumers: tuple[str, ...] = ("consumer-a", "consumer-b")
                    ) -> tuple[Path, Path, dict[str, str]]:
    """A tiny bundle, an embedded store config and the environment engine processes run with (one
    ``PYTHONHASHSEED`` for all: with vLLM installed, LMCache seeds its hash chain from vLLM's, which is
    random per process without it; docs/engines.md#hash-agreement)."""
    from tests.bundles import write_tiny_bundle

    bundle = tmp_path / "bundle"
    write_tiny_bundle(bundle, consumers=consumers)
    return bundle, write_store_yaml(tmp_path / "store.yaml", tmp_path / "disk"), {
        "SCD_STORE_HOME": str(tmp_path / "home"), "PYTHONHASHSEED": "0"}


def make_engine(model: str, config: LMCacheEngineConfig, kv: torch.Tensor, heads: int,
                record_positions: bool = True) -> tuple[str, LMCacheEngine]:
    """A post-initialised engine for ``model`` whose KV lives in ``kv`` (``[2, L, T, heads * D]``)."""
    layers, width = kv.shape[1], kv.shape[3]
    metadata = LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=kv.dtype, kv_shape=(layers, 2, config.chunk_size, heads, width // heads))
    instance = f"{model}-{uuid.uuid4().hex[:8]}"
    connector = DenseKVConnector(kv) if record_positions else PositionlessConnector(kv)
    engine = LMCacheEngineBuilder.get_or_create(instance, config, metadata, connector, None, None)
    engine.post_init()
    return instance, engine


def scd_backend(engine: LMCacheEngine):
    """The scd-store plugin instance inside an engine (None when LMCache failed to build it)."""
    return engine.storage_manager.storage_backends.get("scd")
