"""Signed blobs: Ed25519 keyrings, signatures over key + body, rotation, reloads, and the store refusing
what does not verify (a reader holds public keys only, so it cannot sign)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from scd_store.store.blob import BlobError, BlobMeta, SignatureError, decode_blob, encode_blob
from scd_store.store.keyring import SETTLE_S, Keyring
from scd_store.store.keys import generation_of, hash_keys
from scd_store.store.signing import KeyringError, SigningKey, parse_inline_key, parse_key_file
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.disk import DiskTier
from tests.conftest import needs_cryptography, with_cryptography
from tests.store.conftest import HASHES, PAYLOADS, put_all

EVERY = ("*",)
pytestmark = needs_cryptography  # every test here signs or verifies; replace_file stays importable without it
OLD, NEW, ATTACKER = with_cryptography(lambda: tuple(SigningKey(name, bytes([n]) * 32, spaces=EVERY) for n, name in (
    (1, "k1"), (2, "k2"), (3, "k1"))), (None, None, None))
META = BlobMeta("raw", "space-fp", 4)
KEY_A, KEY_B = hash_keys("space-a", generation_of("space-fp"), HASHES[:2])


def replace_file(path, text: str | bytes, mode: int = 0o600) -> None:
    """Write ``path`` as an operator's atomic replace does (a new file renamed over it), settled."""
    tmp = path.with_name(f".{path.name}.tmp")
    (tmp.write_bytes if isinstance(text, bytes) else tmp.write_text)(text)
    tmp.chmod(mode)
    past = time.time() - 2 * SETTLE_S
    os.utime(tmp, (past, past))
    os.replace(tmp, path)


def keyring(tmp_path, *lines: str, name: str = "default.keys") -> Keyring:
    (tmp_path / "keys").mkdir(parents=True, exist_ok=True)
    replace_file(tmp_path / "keys" / name, "".join(line + "\n" for line in lines))
    return Keyring(tmp_path / "keys", reload_s=0)


def public(key: SigningKey) -> str:
    assert key.public is not None
    return key.public.line()


def test_key_files_parse_and_refuse_bad_lines(tmp_path) -> None:
    keys = parse_key_file(f"# rotation\n{NEW.line()}\n{public(OLD)} until=2026-01-01T00:00:00Z\n", "f")
    assert [k.key_id for k in keys] == ["k2", "k1"] and keys[1].until == 1767225600.0
    assert isinstance(keys[0], SigningKey) and not isinstance(keys[1], SigningKey)
    hmac_line = "k1 " + "11" * 32  # the old shared-secret format: refused, with the way out
    with pytest.raises(KeyringError, match="scd-store keys new"):
        parse_key_file(hmac_line, "f")
    for bad in (f"{OLD.line()} {OLD.line()}", "k ed25519-public:nothex", "k ed25519-public:00ff",
                f"{OLD.line()}\n{public(OLD)}", f"bad:id ed25519-public:{'00' * 32}", f"{OLD.line()} until=soon",
                f"{OLD.line()} until=nan", f"{OLD.line()} until=inf", f"{OLD.line()} until=-5",
                f"{OLD.line()} spaces=a", f"k {OLD.line().split()[1]} spaces=*,a", f"k {OLD.line().split()[1]} spaces=",
                f"k {OLD.line().split()[1]} spaces=bad:id", f"k {OLD.line().split()[1]} scope=a"):
        with pytest.raises(KeyringError):
            parse_key_file(bad, "f")
    assert parse_inline_key(f"env1:ed25519-private:{'01' * 32}").key_id == "env1"
    with pytest.raises(KeyringError):
        parse_inline_key("01" * 32)
    with pytest.raises(KeyringError, match="does not exist"):
        Keyring(tmp_path / "nowhere")


def test_per_space_files_win_over_the_default(tmp_path) -> None:
    keyring(tmp_path, OLD.line())
    ring = keyring(tmp_path, NEW.line(), name="space-b.keys")
    assert ring.signer("space-a").key_id == "k1" and ring.signer("space-b").key_id == "k2"
    assert ring.verifier("space-b", "k1") is None
    env = Keyring.from_env(None, {"SCD_STORE_SIGNING_KEY": f"inline:ed25519-private:{'05' * 32} spaces=*"})
    assert env is not None and env.signer("anything").key_id == "inline"
    with pytest.raises(KeyringError, match="names no spaces"):  # an inline key says which spaces it is for
        Keyring.from_env(None, {"SCD_STORE_SIGNING_KEY": f"inline:ed25519-private:{'05' * 32}"})
    assert Keyring.from_env(None, {}) is None


def test_signed_round_trip_and_every_defect(tmp_path) -> None:
    ring = keyring(tmp_path, OLD.line())
    data = encode_blob(META, PAYLOADS[0], key=KEY_A, signer=ring.signer("space-a"))
    blob = decode_blob(data, key=KEY_A, space_id="space-a", keyring=ring, expect_space_fingerprint="space-fp")
    assert bytes(blob.payload) == PAYLOADS[0]
    for i in range(len(data)):  # every flipped byte, signature and key id included
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
    forged = encode_blob(META, PAYLOADS[0], key=KEY_A, signer=ATTACKER)  # the real key id, another private key
    with pytest.raises(SignatureError):
        decode_blob(forged, key=KEY_A, space_id="space-a", keyring=ring)
    stranger = encode_blob(META, PAYLOADS[0], key=KEY_A, signer=SigningKey("k9", bytes([3]) * 32))
    with pytest.raises(SignatureError, match="does not hold"):
        decode_blob(stranger, key=KEY_A, space_id="space-a", keyring=ring)
    assert bytes(decode_blob(data).payload) == PAYLOADS[0]  # framing only, for tools without keys


def test_a_reader_holds_public_keys_only_and_cannot_sign(tmp_path) -> None:
    """The consumer's attack on shared secrets: with HMAC any reader could sign what others accept."""
    producer = keyring(tmp_path / "p", OLD.line())
    reader = keyring(tmp_path / "r", public(OLD))
    assert producer.can_sign and not reader.can_sign
    assert reader.signer("space-a") is None  # nothing to sign with
    genuine = encode_blob(META, PAYLOADS[0], key=KEY_A, signer=producer.signer("space-a"))
    assert bytes(decode_blob(genuine, key=KEY_A, space_id="space-a", keyring=reader).payload) == PAYLOADS[0]
    # all a reader knows is the public key: a blob "signed" with it as a seed is refused by every reader
    assert OLD.public is not None
    fake = SigningKey("k1", OLD.public.public)
    with pytest.raises(SignatureError):
        decode_blob(encode_blob(META, b"kv", key=KEY_A, signer=fake), key=KEY_A, space_id="space-a", keyring=reader)


def test_rotation_accepts_old_and_new_for_a_window(tmp_path) -> None:
    ring = keyring(tmp_path, OLD.line())
    old_blob = encode_blob(META, PAYLOADS[0], key=KEY_A, signer=ring.signer("space-a"))
    keyring(tmp_path, NEW.line(), f"{public(OLD)} until={time.time() + 60:.0f}")  # new key signs, old verifies
    assert ring.signer("space-a").key_id == "k2"
    new_blob = encode_blob(META, PAYLOADS[0], key=KEY_A, signer=ring.signer("space-a"))
    for data in (old_blob, new_blob):
        decode_blob(data, key=KEY_A, space_id="space-a", keyring=ring)
    keyring(tmp_path, NEW.line(), f"{public(OLD)} until={time.time() - 1:.0f}")  # the window is over
    with pytest.raises(SignatureError):
        decode_blob(old_blob, key=KEY_A, space_id="space-a", keyring=ring)
    decode_blob(new_blob, key=KEY_A, space_id="space-a", keyring=ring)


def test_a_key_file_that_stops_parsing_keeps_its_keys_logged_and_counted(tmp_path, caplog) -> None:
    errors: list[str] = []
    ring = keyring(tmp_path, OLD.line())
    ring.on_error = errors.append
    path = tmp_path / "keys" / "default.keys"
    replace_file(path, "k1 12")
    assert ring.signer("space-a").key_id == "k1"
    assert ring.signer("space-a").key_id == "k1"
    assert len(errors) == 1 and "keeping the keys read before" in errors[0]  # once per state of the file
    assert "keeping the keys read before" in caplog.text


def test_a_deleted_key_file_fails_closed(tmp_path) -> None:
    errors: list[str] = []
    replace_file(tmp_path / "one.keys", OLD.line() + "\n")
    ring = Keyring(tmp_path / "one.keys", reload_s=0, on_error=errors.append)
    blob = encode_blob(META, PAYLOADS[0], key=KEY_A, signer=ring.signer("space-a"))
    (tmp_path / "one.keys").unlink()
    assert ring.signer("space-a") is None
    with pytest.raises(SignatureError):
        decode_blob(blob, key=KEY_A, space_id="space-a", keyring=ring)
    assert len(errors) == 1 and "gone" in errors[0]
    replace_file(tmp_path / "one.keys", OLD.line() + "\n")  # back: the keys work again
    assert ring.signer("space-a").key_id == "k1"
    decode_blob(blob, key=KEY_A, space_id="space-a", keyring=ring)


@pytest.fixture
def signed_store(tmp_path, registry):
    ring = keyring(tmp_path, OLD.line())
    st = TieredStore([CpuTier(1 << 20), DiskTier(tmp_path / "disk", 4 << 20)], registry, chunk_size=4,
                     put_timeout_s=5.0, keyring=ring)
    yield st
    st.close()


def test_the_store_signs_and_serves_only_what_verifies(signed_store) -> None:
    keys = put_all(signed_store)
    signed_store.flush()
    consumer = signed_store.consumer("pair-a", "consumer-m", "space-fp")
    assert [bytes(c.payload) for c in consumer.get(HASHES)] == PAYLOADS
    forged = encode_blob(META, b"attacker kv", key=keys[1], signer=ATTACKER)
    # the disk (a directory other processes share) is verified; this process's memory holds only blobs
    # it wrote or verified, so their signature is not checked again there
    signed_store.tiers[0].delete_now(keys[1])
    asyncio.run(signed_store.tiers[1].put(keys[1], forged))
    chunks = consumer.get(HASHES)
    assert len(chunks) == 1 and bytes(chunks[0].payload) == PAYLOADS[0]
    assert signed_store.stats.value("bad_signatures") == 1
    assert not signed_store.tiers[1].path_for(keys[1]).exists()  # this host's disk: the reader deleted it


def test_a_producer_without_a_key_for_its_space_stores_nothing(tmp_path, registry) -> None:
    ring = keyring(tmp_path, OLD.line(), name="space-b.keys")
    with TieredStore([CpuTier(1 << 20)], registry, chunk_size=4, keyring=ring) as st:
        assert put_all(st) == []
        assert st.stats.value("unsigned_puts") == 6 and st.tiers[0].usage().items == 0


def test_a_reader_process_stores_nothing_it_could_sign(tmp_path, registry) -> None:
    """A consumer's keyring (public keys only) cannot sign even if its process tried to write."""
    ring = keyring(tmp_path, public(OLD))
    with TieredStore([CpuTier(1 << 20)], registry, chunk_size=4, keyring=ring) as st:
        assert put_all(st) == []
        assert st.stats.value("unsigned_puts") == 6


def test_a_key_removed_from_the_keyring_ends_what_it_signed_in_memory_too(tmp_path, registry) -> None:
    """Rotating a compromised key out: blobs it signed are misses from then on, in this process's memory tiers
    as well (where the signature is not checked again, but its key must still be held)."""
    ring = keyring(tmp_path, OLD.line())
    with TieredStore([CpuTier(1 << 20)], registry, chunk_size=4, keyring=ring) as st:
        put_all(st)
        consumer = st.consumer("pair-a", "consumer-m", "space-fp")
        assert len(consumer.get(HASHES)) == 6
        keyring(tmp_path, NEW.line())  # k1 is gone
        assert consumer.get(HASHES) == []
        assert st.stats.value("bad_signatures") == 6 and st.tiers[0].usage().items == 0  # dropped from memory


def test_a_reader_missing_a_key_never_deletes_what_it_signed_from_a_shared_disk(tmp_path, registry) -> None:
    """A reader whose keys lag a rotation (or whose key file is briefly gone) must not delete genuine blobs."""
    producer = keyring(tmp_path / "p", OLD.line())
    with TieredStore([DiskTier(tmp_path / "disk", 4 << 20)], registry, chunk_size=4, keyring=producer) as st:
        keys = put_all(st)
    lagging = keyring(tmp_path / "r", public(NEW))
    with TieredStore([DiskTier(tmp_path / "disk", 4 << 20)], registry, chunk_size=4, keyring=lagging) as st:
        assert st.consumer("pair-a", "consumer-m", "space-fp").get(HASHES) == []
        assert all(st.tiers[0].path_for(k).exists() for k in keys)


def test_key_files_are_plain_files_their_owner_alone_may_change(tmp_path) -> None:
    """Whoever can write a reader's key file or directory could add their own public key (forgeries accepted) or
    plant a FIFO (a reader hung on its reload): refused, never followed."""
    (tmp_path / "keys").mkdir()
    target = tmp_path / "elsewhere.keys"
    target.write_text(public(OLD) + "\n")
    (tmp_path / "keys" / "default.keys").symlink_to(target)
    with pytest.raises(KeyringError, match="plain file"):
        Keyring(tmp_path / "keys")
    (tmp_path / "keys" / "default.keys").unlink()
    os.mkfifo(tmp_path / "keys" / "default.keys")
    with pytest.raises(KeyringError, match="regular file"):
        Keyring(tmp_path / "keys")  # returns at once: opened non-blocking
    (tmp_path / "keys" / "default.keys").unlink()
    (tmp_path / "keys" / "default.keys").write_text(public(OLD) + "\n")
    (tmp_path / "keys" / "default.keys").chmod(0o666)
    with pytest.raises(KeyringError, match="may write"):
        Keyring(tmp_path / "keys")
    (tmp_path / "keys" / "default.keys").chmod(0o644)  # public keys may be read by anyone
    (tmp_path / "keys").chmod(0o777)
    with pytest.raises(KeyringError, match="the key directory"):
        Keyring(tmp_path / "keys")
    (tmp_path / "keys").chmod(0o755)
    assert Keyring(tmp_path / "keys").verifier("s", "k1") is not None


def test_a_reload_that_cannot_decode_keeps_the_keys_and_a_removed_space_file_fails_closed(tmp_path) -> None:
    errors: list[str] = []
    keyring(tmp_path, public(OLD))
    ring = keyring(tmp_path, public(NEW), name="space-b.keys")
    ring.on_error = errors.append
    path = tmp_path / "keys" / "space-b.keys"
    replace_file(path, b"\xff\xfe not utf-8")
    assert ring.verifier("space-b", "k2") is not None and len(errors) == 1  # kept, logged, counted
    path.unlink()  # a space's own file gone: never the default's keys in its place
    assert ring.verifier("space-b", "k2") is None and ring.verifier("space-b", "k1") is None
    assert ring.verifier("space-a", "k1") is not None and len(errors) == 2 and "gone" in errors[1]
