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
    "registry_path": "JSON file of the registry when there is no Redis (default: `<data dir>/registry/registry.json`; "
                     "never inside a disk tier, and its directory writable by this user only)",
    "stats_redis_url": "Redis URL where counters are shared for `scd-store stats` (default: the Redis tier)",
    "stats_path": "directory of the per-process stats snapshots without Redis (default: `<data dir>/stats`)",
    "metrics_port": "serve Prometheus metrics (`scd_store_*`) on this loopback port",
    "raw_kv_bytes_per_token": "raw KV bytes per token for `bytes_saved` when a space does not say",
    "signing_keys": "an Ed25519 key file, or a directory of `<space_id>.keys` files (+ `default.keys`), from "
                    "`scd-store keys new`: producers hold the private lines and sign every blob, readers hold the "
                    "public lines and accept only blobs that verify (docs/reliability.md); never in a bundle. "
                    "Without it, a disk tier's blobs are signed with the host keyring (`<data dir>/keys`), and a "
                    "Redis or peer tier is refused unless `allow_unsigned`",
    "require_signed": "refuse to start without configured signing keys (even for memory-only tiers)",
    "allow_unsigned": "opt out of signing for tiers several processes share (logged as a warning): whoever can "
                      "write to them can then plant codes readers decode",
    "registry_refresh_s": "how often the registry's version is checked; a revoked or changed space or pair takes "
                          "effect within this (0: never)",
}
TIER_DOCS = {
    "kind": f"one of {', '.join(TIER_KINDS)}",
    "max_bytes": "byte bound of the tier (`512MiB`, `2GB`, ints); for Redis only with `apply_server_maxmemory`",
    "path": "disk tier directory (default: `<data dir>/store`; created 0700, refused when other users may write "
            "it); peer tier: its directory of who holds what (default: `<data dir>/store/peers`) when it has no "
            "`url`",
    "url": "Redis URL: `redis://`, `rediss://` (TLS), `redis+cluster://h1:p1,h2:p2`, `redis+sentinel://h:p/svc`; "
           "for a peer tier, where its directory lives (between hosts)",
    "ttl_s": "Redis: expire blobs after this many seconds, refreshed by the producer from the hits readers "
             "report (null: never); with `maxmemory-policy volatile-lru` only keys with a TTL are evicted, never "
             "the registry",
    "max_value_bytes": "largest blob the tier accepts or reads (Redis, disk, peers; larger ones are never written "
                       "there, `oversized_writes`, and a larger one found there is a miss)",
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
                          "`SIGNING_KEYS`, `REQUIRE_SIGNED`, `ALLOW_UNSIGNED`, `REGISTRY_REFRESH_S`"),
    ("SCD_STORE_SIGNING_KEY", "one key inline, `key_id:ed25519-private:HEX` or `key_id:ed25519-public:HEX` (for "
                              "every space; first before the file's)"),
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
