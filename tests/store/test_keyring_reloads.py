"""Keys per space and key reloads an operator's edits cannot race: the attacks of a producer of one space on
another, and of non-atomic rewrites, links and vanishing files on a reader's keys."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from scd_store.store import keyring as keyring_module
from scd_store.store.blob import BlobMeta, SignatureError, decode_blob, encode_blob
from scd_store.store.keyring import Keyring
from scd_store.store.keys import generation_of, hash_keys
from scd_store.store.signing import KeyringError, SigningKey, write_key_file
from scd_store.store.tiers.peer import PeerTier
from scd_store.store.transfer.directory import FilePeerDirectory
from scd_store.store.transfer.entry import LocationEntry
from tests.conftest import skip_without_cryptography
from tests.store.conftest import HASHES
from tests.store.test_signing import replace_file

skip_without_cryptography()  # every test here signs or verifies
A_KEY = SigningKey("ka", bytes([1]) * 32, spaces=("space-a",))
B_KEY = SigningKey("kb", bytes([2]) * 32, spaces=("space-b",))
META = BlobMeta("raw", "fp-b", 4)
(KEY_IN_B,) = hash_keys("space-b", generation_of("fp-b"), HASHES[:1])


def pub(key: SigningKey) -> str:
    assert key.public is not None
    return key.public.line()


def test_a_key_signs_and_verifies_only_the_spaces_it_was_made_for(tmp_path) -> None:
    """The producer of space A holds a key made for A: it cannot sign B's blobs, and what it signs under B's key
    is refused by B's readers, who hold both public keys."""
    replace_file(tmp_path / "producer-a.keys", A_KEY.line() + "\n")
    replace_file(tmp_path / "reader.keys", pub(A_KEY) + "\n" + pub(B_KEY) + "\n", 0o644)
    producer_a, reader = Keyring(tmp_path / "producer-a.keys"), Keyring(tmp_path / "reader.keys")
    assert producer_a.signer("space-a") is not None and producer_a.signer("space-b") is None
    assert reader.verifier("space-b", "ka") is None and reader.verifier("space-a", "ka") is not None
    forged = encode_blob(META, b"A's kv for B's prompt", key=KEY_IN_B, signer=A_KEY)  # A's genuine key, B's key
    with pytest.raises(SignatureError, match="does not hold"):
        decode_blob(forged, key=KEY_IN_B, space_id="space-b", keyring=reader)
    genuine = encode_blob(META, b"kv", key=KEY_IN_B, signer=B_KEY)
    assert bytes(decode_blob(genuine, key=KEY_IN_B, space_id="space-b", keyring=reader).payload) == b"kv"


def test_a_producer_cannot_publish_another_spaces_blob_in_its_peer_arena(tmp_path) -> None:
    """The attack through the peer tier: A's producer publishes under B's key with a directory entry it signs."""
    replace_file(tmp_path / "producer-a.keys", A_KEY.line() + "\n")
    replace_file(tmp_path / "reader.keys", pub(A_KEY) + "\n" + pub(B_KEY) + "\n", 0o644)
    counts: dict[str, int] = {}
    source = PeerTier(FilePeerDirectory(tmp_path / "peers"), publish_bytes=1 << 16, transfer="copy")
    reader = PeerTier(FilePeerDirectory(tmp_path / "peers"), transfer="copy")
    source.attach(keyring=Keyring(tmp_path / "producer-a.keys"), count=lambda n, a: counts.update({n: a}))
    reader.attach(keyring=Keyring(tmp_path / "reader.keys"), count=lambda n, a: counts.update({"reader:" + n: a}))
    asyncio.run(source.start())
    asyncio.run(reader.start())
    try:
        asyncio.run(source.put_many([(KEY_IN_B, encode_blob(META, b"kv", key=KEY_IN_B, signer=A_KEY))]))
        assert counts.get("unsigned_puts") == 1  # no key made for B: not published
        assert asyncio.run(reader.contains_many([KEY_IN_B])) == [False]
        # the same, with an entry the arena's owner signs itself with its own space's key
        assert source.source is not None
        (ref,) = source.source.publish({KEY_IN_B: b"forged"})
        info = source.source.info()
        from scd_store.store.transfer.entry import info_digest

        entry = LocationEntry.make(ref, info.name, info_digest(info.to_bytes()), A_KEY)
        source.directory.record_entries([entry])
        assert asyncio.run(reader.get_many([KEY_IN_B])) == [None]
        assert counts.get("reader:refused_locations", 0) >= 1
    finally:
        asyncio.run(source.close())
        asyncio.run(reader.close())


def test_shared_files_name_their_spaces_and_space_files_serve_their_own(tmp_path) -> None:
    unscoped = SigningKey("k1", bytes([1]) * 32)  # a line from before keys had scopes
    (tmp_path / "keys").mkdir()
    replace_file(tmp_path / "keys" / "default.keys", unscoped.line() + "\n")
    with pytest.raises(KeyringError, match="names no spaces"):
        Keyring(tmp_path / "keys")
    replace_file(tmp_path / "one.keys", unscoped.line() + "\n")
    with pytest.raises(KeyringError, match="names no spaces"):
        Keyring(tmp_path / "one.keys")
    (tmp_path / "keys" / "default.keys").unlink()
    replace_file(tmp_path / "keys" / "space-a.keys", unscoped.line() + "\n")  # its file's space
    ring = Keyring(tmp_path / "keys")
    assert ring.signer("space-a") is not None and ring.signer("space-b") is None
    replace_file(tmp_path / "keys" / "space-a.keys", B_KEY.line() + "\n")  # a key made for B in A's file
    with pytest.raises(KeyringError, match="not for 'space-a'"):
        Keyring(tmp_path / "keys")


def test_an_in_place_rewrite_keeps_the_keys_read_before_and_is_counted(tmp_path) -> None:
    errors: list[str] = []
    path = tmp_path / "reader.keys"
    replace_file(path, pub(A_KEY) + "\n", 0o644)
    ring = Keyring(path, reload_s=0, on_error=errors.append)
    with open(path, "w") as f:  # truncated, then written: a reader may see it half done
        f.write(pub(B_KEY) + "\n")
    os.utime(path, (1, 1))  # settled long ago: refused for how it was written, not when
    assert ring.verifier("space-a", "ka") is not None and ring.verifier("space-b", "kb") is None
    assert len(errors) == 1 and "in place" in errors[0]
    replace_file(path, pub(B_KEY) + "\n", 0o644)  # the same content, renamed over it: taken
    assert ring.verifier("space-b", "kb") is not None and ring.verifier("space-a", "ka") is None


def test_a_truncate_then_write_loop_never_leaves_a_reader_without_its_key(tmp_path) -> None:
    """The measured race: a non-atomic rewrite loop left a key missing in most lookups, with no error counted."""
    errors: list[str] = []
    path = tmp_path / "reader.keys"
    text = pub(A_KEY) + "\n"
    replace_file(path, text, 0o644)
    ring = Keyring(path, reload_s=0, on_error=errors.append)
    stop = threading.Event()

    def rewrite() -> None:
        n = 0
        while not stop.is_set():
            with open(path, "r+") as f:
                f.truncate(0)
                f.write(text)
            n += 1
            os.utime(path, (n, n))

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        missing = sum(ring.verifier("space-a", "ka") is None for _ in range(5000))
    finally:
        stop.set()
        writer.join()
    assert missing == 0 and errors and all("in place" in e for e in errors)


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_file_swapped_for_a_link_or_fifo_is_refused_with_a_count(tmp_path, kind) -> None:
    errors: list[str] = []
    (tmp_path / "keys").mkdir()
    replace_file(tmp_path / "keys" / "space-a.keys", pub(A_KEY) + "\n", 0o644)
    ring = Keyring(tmp_path / "keys", reload_s=0, on_error=errors.append)
    swap = tmp_path / "keys" / ".swap"
    if kind == "link":
        replace_file(tmp_path / "attacker.keys", pub(B_KEY).replace("space-b", "space-a") + "\n", 0o644)
        swap.symlink_to(tmp_path / "attacker.keys")
    else:
        os.mkfifo(swap)
    os.replace(swap, tmp_path / "keys" / "space-a.keys")
    assert ring.verifier("space-a", "ka") is not None and ring.verifier("space-a", "kb") is None  # returns at once
    assert ring.verifier("space-a", "ka") is not None
    assert len(errors) == 1 and "no plain file" in errors[0]


def test_a_file_vanishing_during_a_reload_drops_its_own_scope_only(tmp_path, monkeypatch) -> None:
    errors: list[str] = []
    (tmp_path / "keys").mkdir()
    every = SigningKey("kd", bytes([4]) * 32, spaces=("*",))
    replace_file(tmp_path / "keys" / "default.keys", pub(every) + "\n", 0o644)
    replace_file(tmp_path / "keys" / "space-a.keys", pub(A_KEY) + "\n", 0o644)
    replace_file(tmp_path / "keys" / "space-b.keys", pub(B_KEY) + "\n", 0o644)
    ring = Keyring(tmp_path / "keys", reload_s=0, on_error=errors.append)
    replace_file(tmp_path / "keys" / "space-a.keys", pub(A_KEY) + "\n", 0o644)  # changed: re-read next time
    lstat = os.lstat

    def racing(path, *args, **kwargs):  # space-a.keys is listed, then gone when looked at
        if str(path).endswith("space-a.keys"):
            raise FileNotFoundError(path)
        return lstat(path, *args, **kwargs)

    monkeypatch.setattr(keyring_module.os, "lstat", racing)
    assert ring.verifier("space-a", "ka") is None and ring.verifier("space-a", "kd") is None  # its own: gone
    assert ring.verifier("space-b", "kb") is not None and ring.verifier("space-c", "kd") is not None
    assert len(errors) == 1 and "space-a.keys is gone" in errors[0]
    monkeypatch.setattr(keyring_module.os, "lstat", lstat)
    assert ring.verifier("space-a", "ka") is not None  # back


def test_a_file_still_being_written_is_read_once_it_settles(tmp_path) -> None:
    (tmp_path / "keys").mkdir()
    replace_file(tmp_path / "keys" / "space-a.keys", pub(A_KEY) + "\n", 0o644)
    ring = Keyring(tmp_path / "keys", reload_s=0)
    fresh = tmp_path / "keys" / "space-b.keys"
    write_key_file(fresh, [pub(B_KEY)], private=False)  # just now
    assert ring.verifier("space-b", "kb") is None
    os.utime(fresh, (1, 1))
    assert ring.verifier("space-b", "kb") is not None


def test_two_replaces_between_reloads_are_read_as_replaces(tmp_path) -> None:
    """A rotation done quickly (add k2, then remove k1, both renamed over the file before the next reload) could
    give the second file the inode the keyring remembered: read as an edit in place, the removed key verified on.
    The keyring holds the file it read open, so no newer file can have its inode."""
    (tmp_path / "keys").mkdir()
    path = tmp_path / "keys" / "space-a.keys"
    old = SigningKey("k1", bytes([5]) * 32, spaces=("space-a",))
    replace_file(path, pub(old) + "\n", 0o644)
    first = os.stat(path).st_ino
    errors: list[str] = []
    ring = Keyring(tmp_path / "keys", reload_s=0, on_error=errors.append)
    replace_file(path, pub(old) + "\n" + pub(A_KEY) + "\n", 0o644)
    replace_file(path, pub(A_KEY) + "\n", 0o644)
    assert os.stat(path).st_ino != first  # the inode the keyring remembers is still taken (by its open file)
    assert ring.verifier("space-a", "k1") is None and ring.verifier("space-a", "ka") is not None and not errors


def test_a_file_cut_short_is_not_read_until_whole(tmp_path) -> None:
    """A new file written in place, its writer stalled mid-line: read then, a key would serve without its until=
    (or for a space named by a prefix). A file that does not end in a newline is refused, counted, read once whole."""
    (tmp_path / "keys").mkdir()
    replace_file(tmp_path / "keys" / "space-a.keys", pub(A_KEY) + "\n", 0o644)
    errors: list[str] = []
    ring = Keyring(tmp_path / "keys", reload_s=0, on_error=errors.append)
    path = tmp_path / "keys" / "space-b.keys"
    with open(path, "w") as f:
        f.write(pub(B_KEY))  # no end of line yet: its until= is still to come
    os.chmod(path, 0o644)
    os.utime(path, (1, 1))
    assert ring.verifier("space-b", "kb") is None and len(errors) == 1 and "newline" in errors[0]
    with open(path, "a") as f:
        f.write(" until=1700000000\n")  # whole now: the key ended in 2023
    os.utime(path, (2, 2))
    assert ring.verifier("space-b", "kb") is None and ring.verifier("space-a", "ka") is not None
    replace_file(path, pub(B_KEY) + "\n", 0o644)
    assert ring.verifier("space-b", "kb") is not None
