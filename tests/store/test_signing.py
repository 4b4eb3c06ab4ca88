"""Signed blobs: keyrings, tags over key + body, rotation, and the store refusing what does not verify."""

from __future__ import annotations

import os
import time

import pytest

from scd_store.store.blob import BlobError, BlobMeta, SignatureError, decode_blob, encode_blob
from scd_store.store.keys import generation_of, hash_keys
from scd_store.store.signing import Keyring, KeyringError, SigningKey, parse_inline_key, parse_key_file
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.disk import DiskTier
from tests.store.conftest import HASHES, PAYLOADS, put_all

OLD, NEW, ATTACKER = "11" * 32, "22" * 32, "33" * 32
META = BlobMeta("raw", "space-fp", 4)
KEY_A, KEY_B = hash_keys("space-a", generation_of("space-fp"), HASHES[:2])


def keyring(tmp_path, text: str, name: str = "default.keys") -> Keyring:
    (tmp_path / "keys").mkdir(exist_ok=True)
    (tmp_path / "keys" / name).write_text(text)
    return Keyring(tmp_path / "keys", reload_s=0)


def test_key_files_parse_and_refuse_bad_lines(tmp_path) -> None:
    keys = parse_key_file(f"# rotation\nk2 {NEW}\nk1 {OLD} until=2026-01-01T00:00:00Z\n", "f")
    assert [k.key_id for k in keys] == ["k2", "k1"] and keys[1].until == 1767225600.0
    assert parse_key_file("k base64:" + "A" * 24, "f")[0].secret == bytes(18)
    for bad in (f"k {OLD} {OLD}", "k nothex", "k 00ff", f"k {OLD}\nk {NEW}", f"bad:id {OLD}", f"k {OLD} until=soon"):
        with pytest.raises(KeyringError):
            parse_key_file(bad, "f")
    assert parse_inline_key(f"env1:{OLD}").key_id == "env1"
    with pytest.raises(KeyringError):
        parse_inline_key(OLD)
    with pytest.raises(KeyringError, match="does not exist"):
        Keyring(tmp_path / "nowhere")


def test_per_space_files_win_over_the_default(tmp_path) -> None:
    ring = keyring(tmp_path, f"shared {OLD}\n")
    (tmp_path / "keys" / "space-b.keys").write_text(f"own {NEW}\n")
    ring = Keyring(tmp_path / "keys", reload_s=0)
    assert ring.signer("space-a").key_id == "shared" and ring.signer("space-b").key_id == "own"
    assert ring.verifier("space-b", "shared") is None
    env = Keyring.from_env(None, {"SCD_STORE_SIGNING_KEY": f"inline:{NEW}"})
    assert env is not None and env.signer("anything").key_id == "inline"
    assert Keyring.from_env(None, {}) is None


def test_signed_round_trip_and_every_defect(tmp_path) -> None:
    ring = keyring(tmp_path, f"k1 {OLD}\n")
    data = encode_blob(META, PAYLOADS[0], key=KEY_A, signer=ring.signer("space-a"))
    blob = decode_blob(data, key=KEY_A, space_id="space-a", keyring=ring, expect_space_fingerprint="space-fp")
    assert bytes(blob.payload) == PAYLOADS[0]
    for i in range(len(data)):  # every flipped byte, tag and key id included
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises(BlobError):
            decode_blob(bytes(bad), key=KEY_A, space_id="space-a", keyring=ring)
    for n in range(len(data)):
        with pytest.raises(BlobError):
            decode_blob(data[:n], key=KEY_A, space_id="space-a", keyring=ring)
    with pytest.raises(SignatureError, match="moved"):  # a genuine blob copied under another chunk's key
        decode_blob(data, key=KEY_B, space_id="space-a", keyring=ring)
    with pytest.raises(SignatureError, match="unsigned"):
        decode_blob(encode_blob(META, PAYLOADS[0]), key=KEY_A, space_id="space-a", keyring=ring)
    forged = encode_blob(META, PAYLOADS[0], key=KEY_A, signer=SigningKey("k1", bytes.fromhex(ATTACKER)))
    with pytest.raises(SignatureError):
        decode_blob(forged, key=KEY_A, space_id="space-a", keyring=ring)
    stranger = encode_blob(META, PAYLOADS[0], key=KEY_A, signer=SigningKey("k9", bytes.fromhex(ATTACKER)))
    with pytest.raises(SignatureError, match="does not hold"):
        decode_blob(stranger, key=KEY_A, space_id="space-a", keyring=ring)
    assert bytes(decode_blob(data).payload) == PAYLOADS[0]  # framing only, for tools without keys


def test_rotation_accepts_old_and_new_for_a_window(tmp_path) -> None:
    ring = keyring(tmp_path, f"k1 {OLD}\n")
    old_blob = encode_blob(META, PAYLOADS[0], key=KEY_A, signer=ring.signer("space-a"))
    keyring(tmp_path, f"k2 {NEW}\nk1 {OLD} until={time.time() + 60:.0f}\n")  # step 2: new key signs, old verifies
    assert ring.signer("space-a").key_id == "k2"
    new_blob = encode_blob(META, PAYLOADS[0], key=KEY_A, signer=ring.signer("space-a"))
    for data in (old_blob, new_blob):
        decode_blob(data, key=KEY_A, space_id="space-a", keyring=ring)
    keyring(tmp_path, f"k2 {NEW}\nk1 {OLD} until={time.time() - 1:.0f}\n")  # the window is over
    with pytest.raises(SignatureError):
        decode_blob(old_blob, key=KEY_A, space_id="space-a", keyring=ring)
    decode_blob(new_blob, key=KEY_A, space_id="space-a", keyring=ring)


def test_a_half_written_key_file_keeps_the_keys_read_before(tmp_path) -> None:
    ring = keyring(tmp_path, f"k1 {OLD}\n")
    (tmp_path / "keys" / "default.keys").write_text("k1 12")
    os.utime(tmp_path / "keys" / "default.keys", (time.time() + 5, time.time() + 5))
    assert ring.signer("space-a").key_id == "k1"


@pytest.fixture
def signed_store(tmp_path, registry):
    ring = keyring(tmp_path, f"k1 {OLD}\n")
    st = TieredStore([CpuTier(1 << 20), DiskTier(tmp_path / "disk", 4 << 20)], registry, chunk_size=4,
                     put_timeout_s=5.0, keyring=ring)
    yield st
    st.close()


def test_the_store_signs_and_serves_only_what_verifies(signed_store) -> None:
    keys = put_all(signed_store)
    signed_store.flush()
    consumer = signed_store.consumer("pair-a", "consumer-m", "space-fp")
    assert [bytes(c.payload) for c in consumer.get(HASHES)] == PAYLOADS
    forged = encode_blob(META, b"attacker kv", key=keys[1], signer=SigningKey("k1", bytes.fromhex(ATTACKER)))
    import asyncio

    # the disk (a directory other local users may write) is verified; this process's memory holds only
    # blobs it wrote or verified, so its tag is not checked again there
    signed_store.tiers[0].delete_now(keys[1])
    asyncio.run(signed_store.tiers[1].put(keys[1], forged))
    chunks = consumer.get(HASHES)
    assert len(chunks) == 1 and bytes(chunks[0].payload) == PAYLOADS[0]
    assert signed_store.stats.value("bad_signatures") == 1
    assert not signed_store.tiers[1].path_for(keys[1]).exists()  # this host's disk: the reader deleted it


def test_a_producer_without_a_key_for_its_space_stores_nothing(tmp_path, registry) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "space-b.keys").write_text(f"k1 {OLD}\n")
    with TieredStore([CpuTier(1 << 20)], registry, chunk_size=4, keyring=Keyring(tmp_path / "keys")) as st:
        assert put_all(st) == []
        assert st.stats.value("unsigned_puts") == 6 and st.tiers[0].usage().items == 0
