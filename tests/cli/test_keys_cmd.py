"""``scd-store keys new`` / ``keys public``: pairs whose private half stays with producers."""

from __future__ import annotations

import os

from scd_store.cli.main import main
from scd_store.store.blob import BlobMeta, SignatureError, decode_blob, encode_blob
from scd_store.store.keyring import Keyring
from scd_store.store.signing import SigningKey, VerifyKey, parse_key_file
from tests.conftest import needs_cryptography

pytestmark = needs_cryptography  # every test here makes, signs or verifies with keys


def test_a_pair_for_one_space_signs_that_space_only(tmp_path, capsys) -> None:
    for space in ("space-a", "space-b"):  # the directories do not exist yet: made 0700
        assert main(["keys", "new", "--key-id", f"k-{space}", "--space", space, "--private", str(tmp_path / "prod"),
                     "--public", str(tmp_path / "read")]) == 0
    assert oct((tmp_path / "prod").stat().st_mode & 0o777) == "0o700"
    assert oct((tmp_path / "prod" / "space-a.keys").stat().st_mode & 0o777) == "0o600"
    producer, reader = Keyring(tmp_path / "prod"), Keyring(tmp_path / "read")
    assert not reader.can_sign and all(isinstance(k, VerifyKey) for k in parse_key_file(
        (tmp_path / "read" / "space-a.keys").read_text(), "f"))
    key_b = "scd:space-b:v3.0123456789abcdef:" + "0" * 32
    signed_by_a = encode_blob(BlobMeta("raw", "fp", 1), b"kv", key=key_b, signer=producer.signer("space-a"))
    try:
        decode_blob(signed_by_a, key=key_b, space_id="space-b", keyring=reader)
        raise AssertionError("space a's key verified space b's blob")
    except SignatureError:
        pass
    good = encode_blob(BlobMeta("raw", "fp", 1), b"kv", key=key_b, signer=producer.signer("space-b"))
    assert bytes(decode_blob(good, key=key_b, space_id="space-b", keyring=reader).payload) == b"kv"


def test_a_key_names_its_space_or_asks_for_every_space(tmp_path, capsys) -> None:
    base = ["keys", "new", "--key-id", "k1", "--private", str(tmp_path / "p.keys"), "--public", str(tmp_path / "r")]
    assert main(base) == 2 and "--space SPACE" in capsys.readouterr().err  # neither: refused
    assert not (tmp_path / "p.keys").exists()
    assert main([*base, "--all-spaces"]) == 0
    assert "warning" in capsys.readouterr().err
    (every,) = parse_key_file((tmp_path / "p.keys").read_text(), "f")
    assert every.spaces == ("*",) and Keyring(tmp_path / "p.keys").signer("any-space") is not None


def test_a_space_key_appended_to_a_shared_file_signs_its_space_only(tmp_path, capsys) -> None:
    (tmp_path / "one.keys").write_text(SigningKey.generate("old", spaces=("s",)).line() + "\n")
    (tmp_path / "one.keys").chmod(0o600)
    assert main(["keys", "new", "--key-id", "k2", "--space", "t", "--private", str(tmp_path / "one.keys"),
                 "--public", str(tmp_path / "pub.keys"), "--append"]) == 0
    ring = Keyring(tmp_path / "one.keys")
    assert ring.signer("s").key_id == "old" and ring.signer("t").key_id == "k2" and ring.signer("u") is None


def test_files_are_not_overwritten_and_public_lines_derive_from_private_ones(tmp_path, capsys) -> None:
    args = ["keys", "new", "--key-id", "k1", "--space", "s", "--private", str(tmp_path / "p.keys"), "--public",
            str(tmp_path / "r.keys")]
    assert main(args) == 0
    assert main(args) == 2 and "--append" in capsys.readouterr().err
    assert main([*args[:3], "k2", *args[4:], "--append"]) == 0
    assert [k.key_id for k in parse_key_file((tmp_path / "p.keys").read_text(), "f")] == ["k1", "k2"]
    capsys.readouterr()
    assert main(["keys", "public", str(tmp_path / "p.keys")]) == 0
    assert capsys.readouterr().out.splitlines() == (tmp_path / "r.keys").read_text().splitlines()
    assert all(line.endswith("spaces=s") for line in (tmp_path / "r.keys").read_text().splitlines())
    assert os.stat(tmp_path / "p.keys").st_mode & 0o077 == 0
