from __future__ import annotations

import pytest

from scd_store.store.config import ConfigError, StoreConfig, TierConfig, load_config, parse_bytes
from scd_store.store.redis_url import RedisURLError, parse_redis_url


def test_defaults_are_cpu_plus_disk_under_data_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SCD_STORE_HOME", str(tmp_path))
    cfg = load_config(env={})
    assert [t.kind for t in cfg.tiers] == ["cpu", "disk"]
    assert cfg.tiers[1].path == str(tmp_path / "store") and cfg.redis_url is None and cfg.chunk_size == 256


def test_yaml_then_env(tmp_path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text("store:\n  chunk_size: 128\n  tiers:\n    - {kind: cpu, max_bytes: 64MiB}\n"
                    "    - {kind: disk, path: /tmp/x, max_bytes: 1GB}\n")
    cfg = load_config(path, env={"SCD_STORE_REDIS_URL": "redis://127.0.0.1:6390/0", "SCD_STORE_REDIS_TTL_S": "60",
                                 "SCD_STORE_CPU_MAX_BYTES": "2MiB", "SCD_STORE_OP_TIMEOUT_S": "0.5"})
    assert cfg.chunk_size == 128 and cfg.op_timeout_s == 0.5
    assert [t.kind for t in cfg.tiers] == ["cpu", "disk", "redis"]
    assert cfg.tiers[0].max_bytes == 2 << 20 and cfg.tiers[1].max_bytes == 10**9
    assert cfg.tiers[2].ttl_s == 60.0 and cfg.redis_url == "redis://127.0.0.1:6390/0"


def test_env_tier_list() -> None:
    cfg = load_config(env={"SCD_STORE_TIERS": "cpu,redis", "SCD_STORE_REDIS_URL": "redis+cluster://h:1,h:2"})
    assert [t.kind for t in cfg.tiers] == ["cpu", "redis"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tiers=()), "at least one tier"),
    (dict(tiers=(TierConfig("disk", path="/tmp/x"), TierConfig("cpu"))), "fastest first"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(op_timeout_s=0), "op_timeout_s"),
    (dict(registry_url="http://x"), "not a Redis URL|unsupported"),
])
def test_invalid_store_configs(kwargs, message) -> None:
    with pytest.raises((ConfigError, RedisURLError), match=message):
        StoreConfig(**kwargs)


def test_invalid_tier_configs() -> None:
    with pytest.raises(ConfigError, match="unknown tier kind"):
        TierConfig("tape")
    with pytest.raises(ConfigError, match="needs a url"):
        TierConfig("redis")
    with pytest.raises(ConfigError, match="not a byte size"):
        TierConfig("cpu", max_bytes="lots")
    with pytest.raises(ConfigError, match="unknown store config keys"):
        StoreConfig.from_dict({"tierz": []})


def test_parse_bytes() -> None:
    assert parse_bytes("1.5KiB") == 1536 and parse_bytes(7) == 7 and parse_bytes("3 MB") == 3_000_000


def test_redis_urls() -> None:
    t = parse_redis_url("rediss://alice:s%40cret@cache.local:6380/2")
    assert (t.mode, t.tls, t.hosts, t.username, t.password, t.db) == (
        "standalone", True, (("cache.local", 6380),), "alice", "s@cret", 2)
    assert t.redacted() == "rediss://alice:***@cache.local:6380/2"
    assert parse_redis_url("redis://h:1").redacted() == "redis://h:1"
    c = parse_redis_url("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001")
    assert c.mode == "cluster" and len(c.hosts) == 2 and c.password == "pw" and c.username is None
    s = parse_redis_url("redis+sentinel://s1:26379,s2:26379/mymaster/1")
    assert (s.mode, s.service_name, s.db) == ("sentinel", "mymaster", 1)
    assert parse_redis_url("redis://h:1?cluster=true").mode == "cluster"
    for bad in ("http://h", "redis://", "redis+sentinel://h:1", "redis://a:1,b:2", "redis+cluster://h:1/3"):
        with pytest.raises(RedisURLError):
            parse_redis_url(bad)


def test_every_tier_kind_has_a_variable_for_each_of_its_own_settings_only() -> None:
    from scd_store.store.config import TIER_ENV, TIER_FIELDS

    keys = ("max_bytes", "path", "ttl_s", "url", "queue_size", "max_value_bytes", "max_lifetime_s")
    assert set(TIER_ENV.values()) == {(kind, key) for kind, own in TIER_FIELDS.items() for key in keys if key in own}
    assert all(name == f"SCD_STORE_{kind.upper()}_{key.upper()}" for name, (kind, key) in TIER_ENV.items())
    assert "SCD_STORE_CPU_TTL_S" not in TIER_ENV and "SCD_STORE_REDIS_URL" in TIER_ENV


@pytest.mark.parametrize("kind, setting", [
    ("cpu", {"ttl_s": 60}), ("gpu", {"path": "/x"}), ("disk", {"url": "redis://h"}),
    ("cpu", {"max_value_bytes": "1MiB"}), ("redis", {"fsync": True}), ("disk", {"transfer": "nixl"})])
def test_a_setting_the_tier_kind_does_not_use_is_an_error_not_silently_ignored(kind, setting) -> None:
    base = {"url": "redis://127.0.0.1:6379"} if kind == "redis" else {}
    with pytest.raises(ConfigError, match=f"{next(iter(setting))} is not a {kind} tier's setting"):
        TierConfig(kind, **base, **setting)


def test_a_foreign_setting_left_at_its_default_is_accepted_in_any_spelling(tmp_path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text("store:\n  tiers:\n    - {kind: cpu, max_value_bytes: 64MiB, fsync: 'false', publish: true}\n")
    assert StoreConfig.from_yaml(path).tiers[0].kind == "cpu"


def test_store_variables_name_their_fields() -> None:
    from dataclasses import fields

    from scd_store.store.config import STORE_ENV

    assert set(STORE_ENV.values()) <= {f.name for f in fields(StoreConfig)}
    assert all(name == f"SCD_STORE_{key.upper()}" for name, key in STORE_ENV.items())


def test_defaults_come_from_the_defaults_module() -> None:
    from scd_store.store import defaults

    cfg, tier = StoreConfig(tiers=(TierConfig("cpu"),)), TierConfig("cpu")
    assert (cfg.chunk_size, cfg.op_timeout_s, cfg.put_timeout_s, cfg.registry_refresh_s) == (
        defaults.CHUNK_SIZE, defaults.OP_TIMEOUT_S, defaults.PUT_TIMEOUT_S, defaults.REGISTRY_REFRESH_S)
    assert (cfg.retry_backoff_min_s, cfg.retry_backoff_max_s) == (defaults.BACKOFF_MIN_S, defaults.BACKOFF_MAX_S)
    assert (cfg.repair_s, cfg.stats_flush_s) == (defaults.REPAIR_S, defaults.STATS_FLUSH_S)
    assert (tier.queue_size, tier.writers) == (defaults.QUEUE_SIZE, defaults.WRITERS)


def test_repair_and_stats_flush_intervals() -> None:
    cfg = load_config(env={"SCD_STORE_TIERS": "cpu", "SCD_STORE_REPAIR_S": "0", "SCD_STORE_STATS_FLUSH_S": "0.5"})
    assert (cfg.repair_s, cfg.stats_flush_s) == (0.0, 0.5)
    with pytest.raises(ConfigError, match="repair_s must be >= 0"):
        StoreConfig(tiers=(TierConfig("cpu"),), repair_s=-1)
    with pytest.raises(ConfigError, match="stats_flush_s must be > 0"):
        load_config(env={"SCD_STORE_TIERS": "cpu", "SCD_STORE_STATS_FLUSH_S": "0"})


def test_open_store_hands_the_config_down(tmp_path, monkeypatch) -> None:
    from scd_store.store import build
    from scd_store.store.registry import FileRegistry

    seen = {}
    monkeypatch.setattr(build, "TieredStore", lambda tiers, registry, **kwargs: seen.update(kwargs))
    cfg = StoreConfig(tiers=(TierConfig("cpu", max_bytes="1MiB"),), repair_s=0, stats_flush_s=3.0,
                      registry_refresh_s=0, op_timeout_s=1.5)
    build.open_store(cfg, registry=FileRegistry(tmp_path / "registry.json"), share_stats=False)
    assert (seen["repair_s"], seen["stats_flush_s"], seen["registry_refresh_s"]) == (0, 3.0, 0)
    assert (seen["op_timeout_s"], seen["queue_size"], seen["writers"]) == (1.5, [256], [2])


def test_a_redis_tiers_socket_timeout_is_its_deadline() -> None:
    """A longer op_timeout_s (the tier's, else the store's) is not cut short by the client's 2 s socket timeout:
    a busy host's slow reply would be a miss before the deadline it was given."""
    from scd_store.store.build import build_tier

    url = "redis://127.0.0.1:1/0"
    assert build_tier(TierConfig("redis", url=url))._timeouts[0] == 2.0
    assert build_tier(TierConfig("redis", url=url), store_timeout_s=30.0)._timeouts[0] == 30.0
    assert build_tier(TierConfig("redis", url=url, op_timeout_s=7.0), store_timeout_s=30.0)._timeouts[0] == 7.0


@pytest.mark.parametrize("text, value", [("on", True), ("1", True), ("No", False), ("false", False)])
def test_boolean_variables_follow_the_one_rule(text, value) -> None:
    assert load_config(env={"SCD_STORE_TIERS": "cpu", "SCD_STORE_ALLOW_UNSIGNED": text}).allow_unsigned is value


def test_bad_variables_name_themselves() -> None:
    with pytest.raises(ConfigError, match="SCD_STORE_REQUIRE_SIGNED must be true or false"):
        load_config(env={"SCD_STORE_TIERS": "cpu", "SCD_STORE_REQUIRE_SIGNED": "maybe"})
    with pytest.raises(ConfigError, match="SCD_STORE_CHUNK_SIZE"):
        load_config(env={"SCD_STORE_TIERS": "cpu", "SCD_STORE_CHUNK_SIZE": "lots"})
    with pytest.raises(ConfigError, match="SCD_STORE_REDIS_TTL_S"):
        load_config(env={"SCD_STORE_TIERS": "cpu,redis", "SCD_STORE_REDIS_URL": "redis://h:1/0",
                         "SCD_STORE_REDIS_TTL_S": "soon"})


def test_tier_and_store_booleans_from_yaml_text() -> None:
    tiers = (TierConfig("cpu", pinned="yes"), TierConfig("disk", path="/tmp/x", fsync="off"),
             TierConfig("peer", path="/tmp/p", publish="0"),
             TierConfig("redis", url="redis://h:1/0", apply_server_maxmemory=True))
    assert (tiers[0].pinned, tiers[1].fsync, tiers[2].publish, tiers[3].apply_server_maxmemory) == (True, False, False,
                                                                                                 True)
    assert StoreConfig.from_dict({"tiers": [{"kind": "cpu"}], "require_signed": "true"}).require_signed is True
    with pytest.raises(ConfigError, match="cpu tier: pinned must be true or false"):
        TierConfig("cpu", pinned="sometimes")
    with pytest.raises(ConfigError, match="allow_unsigned must be true or false"):
        StoreConfig(tiers=(TierConfig("cpu"),), allow_unsigned=2)


def test_yaml_integers_zero_and_one_are_booleans(tmp_path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text("store:\n  require_signed: 1\n  tiers:\n    - {kind: cpu, pinned: 0}\n"
                    "    - {kind: disk, path: /tmp/x, fsync: 1}\n")
    cfg = load_config(path, env={})
    assert cfg.require_signed is True and cfg.tiers[0].pinned is False and cfg.tiers[1].fsync is True
