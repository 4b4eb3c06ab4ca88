"""``scd-store bench engine-put``: what a producer engine's thread waits for when it stores a prompt.

A real ``LMCacheEngine`` (CPU, :class:`DenseKVConnector`) with the scd-store plugin stores distinct
prompts one after another, as a serving engine's store path does; per prompt the bench times
``LMCacheEngine.store()`` (the engine thread's whole wait) and, inside it, the plugin's
``batched_submit_put_task``. The code space has SmolLM2-135M's KV geometry, fitted to random
correlated KV (encode cost depends on the geometry and the budget, not on the weights). After the
last prompt it waits until every chunk is in the store (``drain_s``) and checks they all are. Then,
in the same run and on the same engine, it stores as many new prompts with the encode on the
engine's thread (the path without the put queue, ``encode_on_engine_thread``), side by side.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from scd_store.bench.decode import space_fitted_to
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.bundle import save_pair, save_space
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.layout import KVLayout

PRODUCER, CONSUMER = "bench-producer", "bench-consumer"


@dataclass(frozen=True, slots=True)
class EnginePutConfig:
    prompts: int = 30
    prompt_tokens: int = 1024
    chunk_tokens: int = 256
    budget: float = 0.24
    layers: int = 30
    kv_heads: int = 3
    head_dim: int = 64

    def __post_init__(self) -> None:
        if min(self.prompts, self.prompt_tokens, self.chunk_tokens) <= 0:
            raise ValueError("prompts, prompt_tokens and chunk_tokens must be positive")


def _random_kv(layout: KVLayout, tokens: int, seed: int) -> KVState:
    g = torch.Generator().manual_seed(seed)
    width = layout.kv_heads * layout.head_dim
    mix = torch.randn(width, width, generator=torch.Generator().manual_seed(99)) / width ** 0.5
    keys = torch.randn(layout.num_layers, tokens, width, generator=g) @ mix
    values = torch.randn(layout.num_layers, tokens, width, generator=g) @ mix
    shape = (layout.num_layers, tokens, layout.kv_heads, layout.head_dim)
    return KVState(keys.view(shape).transpose(1, 2).contiguous(), values.view(shape).transpose(1, 2).contiguous())


def write_bench_bundle(path: Path, layout: KVLayout, budget: float) -> None:
    """A space of ``layout`` fitted to random correlated KV, with an identity decoder for one consumer."""
    space = space_fitted_to(_random_kv(layout, 512, seed=1), layout, budget, "bench-space")
    save_space(path, space, extra={"producer": PRODUCER})
    g, c = layout.groups, layout.width
    save_pair(path, PairDecoder(CONSUMER, space.fingerprint, torch.zeros(g, c, c), torch.zeros(g, c), "c-fp"))


def _ms(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50_ms": round(statistics.median(ordered) * 1e3, 3), "p99_ms": round(p99 * 1e3, 3),
            "max_ms": round(ordered[-1] * 1e3, 3)}


def inline_submit_put(service: Any) -> Any:
    """A ``submit_put`` that builds, encodes and stores on the caller's thread (the path without the
    put queue), for the bench's baseline."""

    def submit_put(model: str, hashes: Any, states: Any, *, release: Any = None, done: Any = None,
                   nbytes: int = 0) -> bool:
        try:
            built = states()
            stored = service.put(model, hashes, built) if built is not None else 0
        finally:
            if release is not None:
                release()
        if done is not None:
            done(stored)
        return True

    return submit_put


def run_engine_put_bench(config: EnginePutConfig) -> dict[str, Any]:
    """Per-prompt store latencies on the engine's thread with the put queue, then (same engine, same
    run, new prompts) with the encode on the engine's thread; and the time until everything is stored."""
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    try:  # LMCache takes its cryptographic chunk hash (sha256_cbor) from vLLM
        import lmcache  # noqa: F401
        import vllm  # noqa: F401
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"bench engine-put drives a real LMCache engine with vLLM's chunk hash; no "
                                  f"{exc.name} here: `make vllm`, or pip install 'scd-store[lmcache,vllm]'",
                                  name=exc.name) from exc
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from scd_store.adapters.lmcache.dense_connector import DenseKVConnector

    layout = KVLayout(config.layers, config.kv_heads, config.head_dim, 100000.0)
    work = Path(tempfile.mkdtemp(prefix="scd-bench-engine-put-"))
    write_bench_bundle(work / "bundle", layout, config.budget)
    (work / "store.yaml").write_text(yaml.safe_dump({"tiers": [{"kind": "cpu", "max_bytes": "1GiB"}],
                                                     "registry_path": str(work / "registry.json"),
                                                     "stats_path": str(work / "stats")}))
    extra = {"storage_plugin.scd.module_path": "scd_store.adapters.lmcache.plugin",
             "storage_plugin.scd.class_name": "ScdStoragePlugin",
             "scd.bundles": str(work / "bundle"), "scd.store_config": str(work / "store.yaml")}
    lm_config = LMCacheEngineConfig.from_defaults(chunk_size=config.chunk_tokens, local_cpu=True,
                                                  max_local_cpu_size=2.0, storage_plugins=["scd"],
                                                  extra_config=extra, pre_caching_hash_algorithm="sha256_cbor")
    width = config.kv_heads * config.head_dim
    kv = torch.zeros(2, config.layers, config.prompt_tokens, width, dtype=torch.float16)
    metadata = LMCacheMetadata(model_name=PRODUCER, world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=kv.dtype,
                               kv_shape=(config.layers, 2, config.chunk_tokens, config.kv_heads, config.head_dim))
    instance = f"bench-engine-put-{os.getpid()}"
    engine = LMCacheEngineBuilder.get_or_create(instance, lm_config, metadata, DenseKVConnector(kv), None, None)
    engine.post_init()
    plugin = engine.storage_manager.storage_backends["scd"]
    try:
        queued = _store_prompts(engine, plugin, kv, layout, config, first=0)
        plugin.service.submit_put = inline_submit_put(plugin.service)
        inline = _store_prompts(engine, plugin, kv, layout, config, first=config.prompts)
        return {"config": {k: getattr(config, k) for k in config.__slots__}, "cpus": os.cpu_count(),
                "put_queue": queued, "encode_on_engine_thread": inline,
                "store_p50_ratio": round(inline["engine_store"]["p50_ms"] / queued["engine_store"]["p50_ms"], 1)}
    finally:
        LMCacheEngineBuilder.destroy(instance)
        shutil.rmtree(work, ignore_errors=True)


def _store_prompts(engine: Any, plugin: Any, kv: torch.Tensor, layout: KVLayout, config: EnginePutConfig,
                   first: int) -> dict[str, Any]:
    """Store prompts ``first .. first + prompts - 1`` one after another, timing ``store()`` and the
    plugin's put; then drain and count the chunks in the store."""
    from scd_store.adapters.lmcache.layout import chunk_hash_bytes

    inner = plugin.batched_submit_put_task
    plugin_times: list[float] = []

    def timed_submit(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            plugin_times.append(time.perf_counter() - t0)

    plugin.batched_submit_put_task = timed_submit
    store_times: list[float] = []
    prompts = []
    try:
        for i in range(first, first + config.prompts):
            state = _random_kv(layout, config.prompt_tokens, seed=100 + i)
            kv.copy_(torch.stack([state.keys, state.values]).permute(0, 1, 3, 2, 4).reshape(kv.shape))
            tokens = torch.arange(config.prompt_tokens) + i * config.prompt_tokens
            prompts.append(tokens)
            t0 = time.perf_counter()
            engine.store(tokens)
            store_times.append(time.perf_counter() - t0)
    finally:
        plugin.batched_submit_put_task = inner
    t0 = time.perf_counter()
    plugin.drain(timeout=600)
    drain_s = time.perf_counter() - t0
    stored = 0
    for tokens in prompts:
        keys = [key for _, _, key in engine.token_database.process_tokens(tokens)]
        stored += plugin.service.contains(PRODUCER, [chunk_hash_bytes(k.chunk_hash) for k in keys])
    return {"engine_store": _ms(store_times), "plugin_put": _ms(plugin_times), "drain_s": round(drain_s, 3),
            "chunks_stored": stored, "chunks_offered": config.prompt_tokens // config.chunk_tokens * config.prompts}
