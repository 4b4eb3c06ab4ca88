"""The configuration reference (docs/configuration.md), generated from the typed config.

``python -m scd_store.store.config_doc > docs/configuration.md``; a test fails when a config field
has no description here or the committed page is stale.
"""

from __future__ import annotations

from dataclasses import MISSING, fields

from scd_store.store.config import TIER_KINDS, StoreConfig, TierConfig

STORE_DOCS = {
    "tiers": "ordered tiers, fastest first (`gpu`, `cpu`, `peer`, `disk`, `redis`); default: cpu 1GiB + disk 8GiB",
    "chunk_size": "tokens per chunk where scd-store hashes tokens itself (`chunk_hashes`: the demo, the "
                  "benches); engines bring their own chunks",
    "op_timeout_s": "bound on every tier operation; a slower one is a miss and a `tier_errors` count",
    "put_timeout_s": "how long a put may wait for a full write-behind queue (back-pressure) before dropping",
    "retry_backoff_min_s": "first retry delay of a failed tier",
    "retry_backoff_max_s": "longest retry delay of a failed tier",
    "registry_url": "Redis URL of the registry (default: the first Redis tier's URL)",
    "registry_path": "JSON file of the registry when there is no Redis (default: `<data dir>/store/registry.json`)",
    "stats_redis_url": "Redis URL where counters are shared for `scd-store stats` (default: the Redis tier)",
    "stats_path": "directory of the per-process stats snapshots without Redis (default: `<data dir>/store/stats`)",
    "metrics_port": "serve Prometheus metrics (`scd_store_*`) on this loopback port",
    "raw_kv_bytes_per_token": "raw KV bytes per token for `bytes_saved` when a space does not say",
    "signing_keys": "a key file, or a directory of `<space_id>.keys` files (+ `default.keys`): producers sign "
                    "every blob with it, readers accept only blobs that verify (docs/reliability.md); never in a "
                    "bundle",
    "require_signed": "refuse to start without signing keys (set it wherever a shared tier is used)",
    "registry_refresh_s": "how often the registry's version is checked; a revoked or changed space or pair takes "
                          "effect within this (0: never)",
}
TIER_DOCS = {
    "kind": f"one of {', '.join(TIER_KINDS)}",
    "max_bytes": "byte bound of the tier (`512MiB`, `2GB`, ints); for Redis only with `apply_server_maxmemory`",
    "path": "disk tier directory (default: `<data dir>/store`); peer tier: its directory of who holds what "
            "(default: `<data dir>/store/peers`) when it has no `url`",
    "url": "Redis URL: `redis://`, `rediss://` (TLS), `redis+cluster://h1:p1,h2:p2`, `redis+sentinel://h:p/svc`; "
           "for a peer tier, where its directory lives (between hosts)",
    "ttl_s": "Redis: expire blobs after this many seconds, refreshed on every hit (null: never); with "
             "`maxmemory-policy volatile-lru` only blobs are evicted, never the registry or counters",
    "max_value_bytes": "largest blob the tier accepts (larger ones are refused and counted)",
    "apply_server_maxmemory": "Redis: set the server's `maxmemory` to `max_bytes`",
    "pinned": "CPU tier: keep blobs in pinned memory (with CUDA) for fast device copies",
    "fsync": "disk tier: fsync every blob before it counts as written",
    "publish": "peer tier: keep this process's blobs in a registered arena of `max_bytes` for other processes "
               "to read (false: read peers only)",
    "transfer": "peer tier: `nixl`, `copy` (this process only) or `auto` (NIXL when it works here)",
    "rescan_s": "disk tier: rebuild the index from the directory this often, so what other processes on the "
                "host wrote is counted and the byte bound holds across them (null: only at start)",
    "queue_size": "write-behind queue length of this tier (lower tiers)",
    "op_timeout_s": "this tier's own deadline per operation (default: the store's `op_timeout_s`)",
    "writers": "background writers draining this tier's queue",
}
ENV = [
    ("SCD_STORE_CONFIG", "path of the YAML file"),
    ("SCD_STORE_HOME", "the data directory (models, bundles, the embedded store); default `~/.cache/scd-store`"),
    ("SCD_STORE_TIERS", "comma-separated tier kinds, e.g. `cpu,redis`"),
    ("SCD_STORE_REDIS_URL", "URL of the Redis tier (adds one when absent)"),
    ("SCD_STORE_<KIND>_<FIELD>", "`MAX_BYTES`, `PATH`, `TTL_S`, `URL`, `QUEUE_SIZE`, `MAX_VALUE_BYTES` of a tier"),
    ("SCD_STORE_DECODE_MATMUL", "`float32` or `bfloat16`: the SCD decode's products where "
                                "`ScdCodec(matmul=\"auto\")` (the default) would choose (bf16 on CPUs with AMX "
                                "tiles, fp32 elsewhere; docs/scd.md)"),
    ("SCD_STORE_GLIBC_MMAP", "`1` keeps glibc's mmap of large blocks in the `scd-store` process (by default it "
                             "reuses freed blocks: `mallopt(M_MMAP_MAX, 0)`, see docs/scd.md)"),
    ("SCD_STORE_<FIELD>", "`CHUNK_SIZE`, `OP_TIMEOUT_S`, `PUT_TIMEOUT_S`, `REGISTRY_URL`, `REGISTRY_PATH`, "
                          "`STATS_REDIS_URL`, `STATS_PATH`, `METRICS_PORT`, `RAW_KV_BYTES_PER_TOKEN`, "
                          "`SIGNING_KEYS`, `REQUIRE_SIGNED`, `REGISTRY_REFRESH_S`"),
    ("SCD_STORE_SIGNING_KEY", "one signing key inline, `key_id:hex` (for every space; first before the file's)"),
]


def _default(f) -> str:
    if f.default is not MISSING:
        return f"`{f.default!r}`" if f.default is not None else "null"
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return "see below" if f.name == "tiers" else f"`{f.default_factory()!r}`"  # type: ignore[misc]
    return "required"


def _table(cls, docs: dict[str, str]) -> list[str]:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in fields(cls):
        kind = str(f.type).replace("|", "\\|")
        rows.append(f"| `{f.name}` | {kind} | {_default(f)} | {docs[f.name]} |")
    return rows


def reference() -> str:
    """The Markdown page."""
    lines = ["# Configuration reference", "",
             "Generated from `scd_store/store/config.py` by `python -m scd_store.store.config_doc`; do not edit.",
             "", "Order: defaults, then the YAML (`--config` / `$SCD_STORE_CONFIG`, top level or under `store:`), "
             "then `SCD_STORE_*` variables. Unknown keys are errors.", "", "## Store (`StoreConfig`)", "",
             *_table(StoreConfig, STORE_DOCS), "", "## Tier (`TierConfig`, one entry of `tiers`)", "",
             *_table(TierConfig, TIER_DOCS), "", "## Environment", "", "| variable | meaning |", "| --- | --- |",
             *[f"| `{k}` | {v} |" for k, v in ENV], "", "## Example", "", "```yaml", "store:",
             "  tiers:", "    - {kind: cpu, max_bytes: 2GiB}",
             "    - {kind: disk, path: /var/lib/scd, max_bytes: 64GiB}",
             "    - {kind: redis, url: 'rediss://scd:secret@redis.internal:6380/0', ttl_s: 86400}",
             "  op_timeout_s: 1.0", "  metrics_port: 9464", "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference(), end="")
