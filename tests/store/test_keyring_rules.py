"""Which keys a store built from its config signs with: configured keys, the host keyring for tiers this
host's processes share, a refusal for tiers other hosts reach, and the operator's opt-out."""

from __future__ import annotations

import asyncio
import multiprocessing
import os

import pytest

from scd_store.store.blob import BlobMeta, encode_blob
from scd_store.store.build import keyring_for, open_store
from scd_store.store.config import ConfigError, StoreConfig, TierConfig
from scd_store.store.fs_safety import UnsafePath
from scd_store.store.host_keys import HOST_FILE, deployment_keys, host_keyring
from scd_store.store.keys import generation_of, hash_keys
from scd_store.store.registry import FileRegistry
from scd_store.store.signing import ALL_SPACES, SigningKey
from scd_store.store.stats import StoreStats
from tests.conftest import needs_cryptography
from tests.store.conftest import HASHES, PAIR, SPACE

NO_ENV: dict[str, str] = {}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SCD_STORE_HOME", str(tmp_path / "home"))
    for name in ("SCD_STORE_SIGNING_KEYS", "SCD_STORE_SIGNING_KEY"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "home"


def config(*kinds: str, tmp_path, **settings) -> StoreConfig:
    tiers = [TierConfig(k, path=str(tmp_path / k) if k == "disk" else None,
                        url="redis://127.0.0.1:1/0" if k == "redis" else None) for k in kinds]
    return StoreConfig(tiers=tuple(tiers), **settings)


def test_memory_only_tiers_need_no_keys(home, tmp_path) -> None:
    assert keyring_for(config("cpu", tmp_path=tmp_path), NO_ENV) is None


@needs_cryptography
def test_a_disk_tier_signs_with_the_host_keyring(home, tmp_path) -> None:
    ring = keyring_for(config("cpu", "disk", tmp_path=tmp_path), NO_ENV)
    assert ring is not None and ring.can_sign
    key_file = home / "keys" / HOST_FILE
    assert oct(key_file.stat().st_mode & 0o777) == "0o600" and oct((home / "keys").stat().st_mode & 0o777) == "0o700"
    again = keyring_for(config("disk", tmp_path=tmp_path), NO_ENV)  # every process of the host: the same key
    assert again is not None and again.signer("s").public == ring.signer("s").public


def _make_host_keyring(directory: str) -> str:
    ring = host_keyring(directory)
    signer = ring.signer("s")
    assert signer is not None and signer.public is not None
    return signer.public.public.hex()


@pytest.mark.slow
@needs_cryptography
def test_processes_starting_together_make_one_host_key(tmp_path) -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        publics = pool.map(_make_host_keyring, [str(tmp_path / "keys")] * 8)
    assert len(set(publics)) == 1
    assert not [p for p in (tmp_path / "keys").iterdir() if p.name != HOST_FILE]  # no temp files left


@needs_cryptography
def test_an_unsafe_host_keyring_is_refused(tmp_path) -> None:
    (tmp_path / "keys").mkdir(mode=0o700)
    host_keyring(tmp_path / "keys")
    os.chmod(tmp_path / "keys" / HOST_FILE, 0o644)  # other users could read the private key
    with pytest.raises(UnsafePath, match="read or write"):
        host_keyring(tmp_path / "keys")
    os.chmod(tmp_path / "keys" / HOST_FILE, 0o600)
    os.chmod(tmp_path / "keys", 0o777)  # other users could swap the key
    with pytest.raises(UnsafePath, match="may write"):
        host_keyring(tmp_path / "keys")


@needs_cryptography
@pytest.mark.parametrize("kind", ["redis", "peer"])
def test_a_tier_other_hosts_reach_needs_configured_keys_or_an_opt_out(home, tmp_path, kind, caplog) -> None:
    with pytest.raises(ConfigError, match="scd-store keys new"):
        keyring_for(config("cpu", kind, tmp_path=tmp_path), NO_ENV)
    with caplog.at_level("WARNING", logger="scd_store.store"):
        assert keyring_for(config("cpu", kind, tmp_path=tmp_path, allow_unsigned=True), NO_ENV) is None
    assert "allow_unsigned" in caplog.text and "plant codes" in caplog.text
    private, public = deployment_keys(tmp_path / "deploy")
    producer = keyring_for(config("cpu", kind, tmp_path=tmp_path, signing_keys=str(private)), NO_ENV)
    reader = keyring_for(config("cpu", kind, tmp_path=tmp_path), {"SCD_STORE_SIGNING_KEYS": str(public)})
    assert producer is not None and producer.can_sign and reader is not None and not reader.can_sign


def test_require_signed_wants_configured_keys(home, tmp_path) -> None:
    with pytest.raises(ConfigError, match="require_signed"):
        keyring_for(config("cpu", "disk", tmp_path=tmp_path, require_signed=True), NO_ENV)
    with pytest.raises(ConfigError, match="contradict"):
        config("cpu", tmp_path=tmp_path, require_signed=True, allow_unsigned=True)


def test_a_registry_inside_a_disk_tier_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="inside the disk tier"):
        config("disk", tmp_path=tmp_path, registry_path=str(tmp_path / "disk" / "registry.json"))


@needs_cryptography
def test_failed_key_reloads_are_counted(home, tmp_path) -> None:
    private, _ = deployment_keys(tmp_path / "deploy")
    stats = StoreStats()
    ring = keyring_for(config("cpu", tmp_path=tmp_path, signing_keys=str(private)), NO_ENV, stats=stats)
    assert ring is not None
    ring.reload_s = 0
    private.write_text("garbage\n")
    os.utime(private, (1, 1))
    assert ring.signer("s") is not None  # the keys read before
    assert stats.value("keyring_errors") == 1


@needs_cryptography
def test_the_embedded_default_refuses_a_planted_file(home, tmp_path) -> None:
    """The default (cpu + disk, no keys configured): a file another writer planted under the disk tier's root
    is a miss, where before its checksum (no MAC) let it be decoded."""
    registry = FileRegistry(tmp_path / "registry" / "registry.json")
    registry.register_space(SPACE)
    registry.register_pair(PAIR)
    cfg = StoreConfig(tiers=(TierConfig("disk", path=str(tmp_path / "disk")),), chunk_size=4)
    with open_store(cfg, registry=registry, share_stats=False) as store:
        key = hash_keys("space-a", generation_of("space-fp"), HASHES[:1])[0]
        planted = encode_blob(BlobMeta("raw", "space-fp", 4), b"planted kv", key=key)  # unsigned, well formed
        asyncio.run(store.tiers[0].put(key, planted))
        assert store.consumer("pair-a", "consumer-m", "space-fp").get(HASHES[:1]) == []
        assert store.stats.value("bad_signatures") == 1
        stranger = SigningKey.generate("host-x", spaces=(ALL_SPACES,))
        forged = encode_blob(BlobMeta("raw", "space-fp", 4), b"kv", key=key, signer=stranger)
        asyncio.run(store.tiers[0].put(key, forged))
        assert store.consumer("pair-a", "consumer-m", "space-fp").get(HASHES[:1]) == []
        store.producer("space-a", "producer-m", "space-fp").put(HASHES[:1], [b"genuine"], [4], codec_id="raw")
        store.flush()
        assert [bytes(c.payload) for c in store.consumer("pair-a", "consumer-m", "space-fp").get(HASHES[:1])] == [
            b"genuine"]
