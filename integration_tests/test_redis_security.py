"""Redis AUTH / ACL users and TLS with a self-signed certificate made here, against real redis-servers."""

from __future__ import annotations

import shutil

import pytest

from integration_tests.redis_servers import RedisServer, make_tls_certs
from integration_tests.store_ops import get_tokens, put_tokens
from scd_store.store.redis_url import RedisURLError, parse_redis_url
from scd_store.store.registry import FileRegistry, Pair, RedisRegistry, Space
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.redis_tier import RedisTier

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificates")

SPACE = Space("sec", "producer-m", "prod-fp", "space-fp", chunk_size=4)
PAIR = Pair("sec-pair", "sec", "consumer-m", "cons-fp", "pair-fp", "space-fp")
TOKENS = list(range(16))
PAYLOADS = [bytes([i]) * 500 for i in range(4)]


def registry(tmp_path) -> FileRegistry:
    reg = FileRegistry(tmp_path / "registry.json")
    reg.register_space(SPACE)
    reg.register_pair(PAIR)
    return reg


def round_trip(url: str, tmp_path) -> list[bytes]:
    store = TieredStore([RedisTier(url)], registry(tmp_path), chunk_size=4, op_timeout_s=2.0)
    try:
        put_tokens(store, "sec", "producer-m", TOKENS, PAYLOADS)
        return [bytes(c.payload) for c in get_tokens(store, "sec-pair", "consumer-m", TOKENS)]
    finally:
        store.close()


def assert_misses_with_errors(url: str, tmp_path) -> None:
    """Every request against ``url`` completes as a miss, counted as tier errors."""
    store = TieredStore([RedisTier(url)], registry(tmp_path), chunk_size=4, op_timeout_s=1.0)
    try:
        put_tokens(store, "sec", "producer-m", TOKENS, PAYLOADS)
        assert get_tokens(store, "sec-pair", "consumer-m", TOKENS) == []
        assert store.stats.value("tier_errors") >= 1
    finally:
        store.close()


def test_acl_user_reads_and_writes_and_bad_credentials_are_misses(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        server.cli("ACL", "SETUSER", "scd", "on", ">s3cret", "~scd:*", "+@all")
        server.cli("ACL", "SETUSER", "default", "off")
        url = f"redis://scd:s3cret@127.0.0.1:{server.port}/0"
        assert round_trip(url, tmp_path) == PAYLOADS
        assert parse_redis_url(url).redacted() == f"redis://scd:***@127.0.0.1:{server.port}/0"
        assert_misses_with_errors(f"redis://scd:wrong@127.0.0.1:{server.port}/0", tmp_path)
        # the registry lives in Redis under the same user (keys scd:__registry__:*)
        reg = RedisRegistry(url)
        reg.register_space(SPACE)
        assert reg.space("sec", "space-fp") == SPACE


def test_tls_with_a_self_signed_certificate(tmp_path):
    certs = make_tls_certs(tmp_path / "certs")
    with RedisServer(tmp_path / "redis", tls=certs) as server:
        assert server.url.startswith("rediss://")
        assert round_trip(server.url, tmp_path) == PAYLOADS
        # with a client certificate too
        client = (f"{server.url}&ssl_certfile={certs / 'client.crt'}&ssl_keyfile={certs / 'client.key'}")
        assert round_trip(client, tmp_path) == PAYLOADS
        # without the CA the server's certificate is not trusted: misses, not garbage
        assert_misses_with_errors(f"rediss://127.0.0.1:{server.port}/0", tmp_path)


@pytest.mark.parametrize("url, match", [
    ("redis://h:1/0?ssl_ca_certs=/x", "need a rediss"),
    ("rediss://h:1/0?ssl_bogus=1", "unknown TLS options"),
    ("rediss://h:1/0?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
    ("rediss://h:1/0?ssl_certfile=/c", "both ssl_certfile and ssl_keyfile"),
])
def test_bad_tls_urls_name_the_problem(url, match):
    with pytest.raises(RedisURLError, match=match):
        parse_redis_url(url)
