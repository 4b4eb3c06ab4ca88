"""A real LMCacheEngine with the scd-store plugin in its own OS process, driven over JSON lines.

``python -m integration_tests.lmcache_process --model M --bundle B --store-yaml Y --chunk C [--scd k=v]``
builds the engine (``LMCacheEngineBuilder``, scd-store's :class:`DenseKVConnector` over one
sequence's KV) and prints ``{"ready": ..., "plugin": bool, "errors": [...]}``, then answers:

- ``{"store": {"tokens": T, "seed": S, "tags": {...}, "skip_chunks": k}}``: synthetic producer KV
  (``tests.bundles.correlated_state``) stored as an engine stores it (``LMCacheEngine.store``, with a
  mask that skips the first ``k`` chunks: chunked prefill), then drained;
- ``{"retrieve": {"tokens": T, "tags": {...}, "out": PATH}}``: ``lookup`` then ``retrieve`` into a
  zeroed buffer, which goes to ``PATH`` (safetensors);
- ``{"counters": ["puts", ...]}``: those store counters of this process (``{name: value}``);
- ``{"exit": true}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from integration_tests.lmcache_engines import make_engine, plugin_config, scd_backend  # noqa: E402
from integration_tests.processes import serve  # noqa: E402
from tests.bundles import LAYOUT, correlated_state  # noqa: E402

MAX_TOKENS = 64


class Errors(logging.Handler):
    """Keeps the error lines LMCache and scd-store log (a plugin that fails to construct is only logged)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def dense_kv(tokens: int, seed: int) -> torch.Tensor:
    """``[2, L, tokens, H*D]`` fp16 KV of a synthetic prompt (its first ``tokens`` of ``MAX_TOKENS``)."""
    state = correlated_state(MAX_TOKENS, seed=seed)
    kv = torch.stack([state.keys, state.values]).permute(0, 1, 3, 2, 4)
    return kv.reshape(2, LAYOUT.num_layers, MAX_TOKENS, LAYOUT.kv_heads * LAYOUT.head_dim)[:, :, :tokens].half()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--store-yaml", required=True)
    parser.add_argument("--chunk", type=int, required=True)
    parser.add_argument("--scd", action="append", default=[], help="extra scd.* settings, key=json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    errors = Errors()
    logging.getLogger().addHandler(errors)
    for name in ("lmcache", "scd_store"):
        logging.getLogger(name).addHandler(errors)
    extra = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.scd)}
    config = plugin_config([args.bundle], args.store_yaml, args.chunk, **extra)
    kv = torch.zeros(2, LAYOUT.num_layers, MAX_TOKENS, LAYOUT.kv_heads * LAYOUT.head_dim, dtype=torch.float16)
    instance, engine = make_engine(args.model, config, kv, LAYOUT.kv_heads)
    plugin = scd_backend(engine)
    print(json.dumps({"ready": args.model, "plugin": plugin is not None, "errors": errors.lines}), flush=True)

    def store(c: dict) -> dict:
        n = c["tokens"]
        kv.zero_()
        kv[:, :, :n] = dense_kv(n, c["seed"])  # a prompt's first n tokens
        mask = torch.ones(n, dtype=torch.bool)
        mask[:c.get("skip_chunks", 0) * args.chunk] = False
        engine.store(torch.arange(n) + 100, mask=mask, request_configs=c.get("tags") or None)
        drained = plugin.drain(timeout=60) if plugin is not None else False
        return {"drained": drained, "puts": plugin.service.store.stats.value("puts") if plugin is not None else 0}

    def retrieve(c: dict) -> dict:
        n = c["tokens"]
        kv.zero_()
        tokens = torch.arange(n) + 100
        tags = c.get("tags") or None
        hit = engine.lookup(tokens, request_configs=tags)
        if hit:
            engine.retrieve(tokens[:hit], request_configs=tags)
        save_file({"kv": kv[:, :, :n].contiguous()}, c["out"])
        return {"hit": hit}

    def counters(names: list[str]) -> dict:
        stats = plugin.service.store.stats if plugin is not None else None
        return {name: stats.value(name) if stats is not None else 0 for name in names}

    def close() -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        LMCacheEngineBuilder.destroy(instance)  # closes the plugin: drains, writes this process's stats

    serve({"store": store, "retrieve": retrieve, "counters": counters}, close)


if __name__ == "__main__":
    main()
