"""The configuration reference (docs/configuration.md), generated from the store's configuration tree.

``python -m scd_store.store.config_doc > docs/configuration.md``. The page lists every
:class:`StoreConfig` / :class:`TierConfig` key and every environment variable by its literal name
(:data:`~scd_store.store.config.STORE_ENV`, :data:`~scd_store.store.config.TIER_ENV`, and
:data:`OTHER_ENV` for those read elsewhere); tests fail when a key or variable is missing here or the
committed page is stale.
"""

from __future__ import annotations

from dataclasses import MISSING, fields

from scd_store.store.config import (
    REDIS_URL_ENV,
    STORE_ENV,
    TIER_ENV,
    TIER_FIELDS,
    TIER_KINDS,
    StoreConfig,
    TierConfig,
)

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
    "repair_s": "how often a producer takes what readers reported on the shared tiers (bad blobs to delete and "
                "rewrite, verified hits whose TTL it refreshes; 0: never)",
    "repair_rate": "blobs a producer rewrites per second at most on readers' reports (the rest wait for a later "
                   "round, `deferred_repairs`); a key is rewritten at most once a minute",
    "stats_flush_s": "how often this process's counters go to the stats sink (Redis or its snapshot file)",
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
    "max_lifetime_s": "Redis: the longest a blob lives however often readers report hits on it, counted from when "
                      "its producer wrote it (default: 8 x `ttl_s`; at least `ttl_s`); the producer refreshes the "
                      "TTL only of blobs it wrote itself, up to this",
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
    "op_timeout_s": "this tier's own deadline per operation (default: the store's `op_timeout_s`); a Redis "
                    "tier's socket timeout and a peer tier's NIXL reads (default 1 s) wait this long too",
    "writers": "background writers draining this tier's queue",
}
OTHER_ENV = [  # variables read outside StoreConfig's fields: by load_config, the keyring, codecs, adapters, tools
    ("SCD_STORE_CONFIG", "`load_config`", "path of the store's YAML file"),
    ("SCD_STORE_TIERS", "`load_config`", "comma-separated tier kinds replacing the YAML's list, e.g. `cpu,redis` "
                                         "(a kind the YAML lacks gets its defaults; `redis` the URL above)"),
    ("SCD_STORE_HOME", "`scd_store.paths`", "the data directory (models, bundles, the embedded store, the registry "
                                            "and stats without Redis, the host keyring); default `~/.cache/scd-store`"),
    ("SCD_STORE_SIGNING_KEY", "the keyring", "one key inline, `key_id:ed25519-private:HEX spaces=SPACE` or "
                                             "`key_id:ed25519-public:HEX spaces=SPACE` (`spaces=*`: every space; "
                                             "a key naming no space is refused; first before the file's)"),
    ("SCD_STORE_DECODE_MATMUL", "the SCD codec", "`float32` or `bfloat16`: the SCD decode's products where "
                                                 "`ScdCodec(matmul=\"auto\")` (the default) would choose (bf16 on "
                                                 "CPUs with AMX tiles or AVX512-BF16, fp32 elsewhere; docs/scd.md)"),
    ("SCD_STORE_GLIBC_MMAP", "the `scd-store` CLI", "true (`1`, `yes`, `on`) keeps glibc's mmap of large blocks in "
                                                    "the `scd-store` process; unset or false, it reuses freed blocks "
                                                    "(`mallopt(M_MMAP_MAX, 0)`, docs/scd.md); any other value is "
                                                    "warned about and ignored"),
    ("SCD_STORE_PYTHON_STDLIB", "the calibration corpora", "directory of the Python standard library sources the "
                                                           "`python` corpus reads (default: this interpreter's), to "
                                                           "pin one Python version's sources"),
]
ENV_NOTES = {  # what a variable of STORE_ENV / TIER_ENV does beyond setting its field
    REDIS_URL_ENV: "; adds a redis tier when the tiers have none, and is the URL of one `SCD_STORE_TIERS` adds",
    "SCD_STORE_SIGNING_KEYS": "; the keyring also takes it before a config's `signing_keys`",
}


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


def _environment() -> list[str]:
    """One row per variable, by its literal name: the store's, the tiers', then the rest."""
    store = [f"| `{name}` | `{key}`{ENV_NOTES.get(name, '')} |" for name, key in STORE_ENV.items()]
    tiers = [f"| `{name}` | {kind} | `{key}`{ENV_NOTES.get(name, '')} |" for name, (kind, key) in TIER_ENV.items()]
    other = [f"| `{name}` | {reader} | {meaning} |" for name, reader, meaning in OTHER_ENV]
    return ["### Store keys", "", "| variable | sets |", "| --- | --- |", *store, "",
            "### Tier keys (every tier of the kind)", "", "| variable | tier | sets |", "| --- | --- | --- |", *tiers,
            "", "### Others", "", "| variable | read by | meaning |", "| --- | --- | --- |", *other]


def reference() -> str:
    """The Markdown page."""
    lines = ["# Configuration reference", "",
             "Generated from `scd_store/store/config.py` by `python -m scd_store.store.config_doc`; do not edit.",
             "", "Order: defaults, then the YAML (`--config` / `$SCD_STORE_CONFIG`, top level or under `store:`), "
             "then `SCD_STORE_*` variables. Unknown keys are errors; booleans are `true`/`false`, `1`/`0`, "
             "`yes`/`no` or `on`/`off`, anything else is an error.", "", "## Store (`StoreConfig`)", "",
             *_table(StoreConfig, STORE_DOCS), "", "## Tier (`TierConfig`, one entry of `tiers`)", "",
             *_table(TierConfig, TIER_DOCS), "", "What each kind takes (a setting of another kind is an error, not "
             "silently ignored):", "", "| kind | settings |", "| --- | --- |",
             *(f"| `{kind}` | {', '.join(f'`{name}`' for name in names)} |" for kind, names in TIER_FIELDS.items()),
             "", "## Environment", "",
             "Every variable scd-store reads, by its name. A variable's text is read as its key's type (byte sizes "
             "and booleans as in the YAML).", "", *_environment(), "", "## Example", "", "```yaml", "store:",
             "  tiers:", "    - {kind: cpu, max_bytes: 2GiB}",
             "    - {kind: disk, path: /var/lib/scd, max_bytes: 64GiB}",
             "    - {kind: redis, url: 'rediss://scd:secret@redis.internal:6380/0', ttl_s: 86400}",
             "  op_timeout_s: 1.0", "  metrics_port: 9464", "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference(), end="")
