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
