from __future__ import annotations

import json

import pytest

from scd_store.store.registry import (
    FileRegistry,
    NotAuthorized,
    NotRegistered,
    Pair,
    RegistryError,
    Space,
    open_registry,
)

SPACE = Space("sp", "base-model", "base-fp", "bundle-fp")
PAIR = Pair("p1", "sp", "tuned-model", "tuned-fp", "pair-fp", "bundle-fp")


def test_register_and_resolve(tmp_path) -> None:
    reg = FileRegistry(tmp_path / "r.json")
    reg.register_space(SPACE)
    reg.register_pair(PAIR)
    again = FileRegistry(tmp_path / "r.json")  # another process reading the same file
    assert again.resolve("p1", "tuned-model", "bundle-fp") == (PAIR, SPACE)
    assert again.authorize_write("sp", "base-model", "bundle-fp") == SPACE
    assert [s.space_id for s in again.spaces()] == ["sp"] and [p.pair_id for p in again.pairs()] == ["p1"]
    assert json.loads((tmp_path / "r.json").read_text())["pairs"][PAIR.ident]["space_id"] == "sp"


def test_errors_are_specific(tmp_path) -> None:
    reg = FileRegistry(tmp_path / "r.json")
    with pytest.raises(NotRegistered, match="code space 'sp' .* is not registered"):
        reg.register_pair(PAIR)
    reg.register_space(SPACE)
    reg.register_pair(PAIR)
    with pytest.raises(NotRegistered, match="pair 'p2'"):
        reg.resolve("p2", "tuned-model", "bundle-fp")
    with pytest.raises(NotRegistered, match="pair 'p1'"):
        reg.resolve("p1", "tuned-model", "another-generation")
    with pytest.raises(NotRegistered, match="'other' is not registered for pair 'p1'"):
        reg.resolve("p1", "other", "bundle-fp")
    with pytest.raises(NotAuthorized, match="only its producer 'base-model'"):
        reg.authorize_write("sp", "tuned-model", "bundle-fp")


def test_conflicting_registration_needs_replace(tmp_path) -> None:
    reg = FileRegistry(tmp_path / "r.json")
    reg.register_space(SPACE)
    reg.register_space(SPACE)  # identical: idempotent
    changed = Space("sp", "other-base", "base-fp", "bundle-fp")  # same generation, other contents
    with pytest.raises(RegistryError, match="already registered"):
        reg.register_space(changed)
    reg.register_space(changed, replace=True)
    assert reg.space("sp", "bundle-fp").producer_model_id == "other-base"


def check_generations_and_revocation(reg) -> None:
    """A new bundle generation of a space is a record of its own (a rollout), not a conflict; revoking one
    generation leaves the other, and every change bumps the version stores watch (also run on Redis by
    integration_tests/test_redis_roles.py)."""
    reg.register_space(SPACE)
    reg.register_pair(PAIR)
    v0 = reg.version()
    new_space = Space("sp", "base-model", "base-fp", "bundle-fp-2")
    new_pair = Pair("p1", "sp", "tuned-model", "tuned-fp", "pair-fp-2", "bundle-fp-2")
    reg.register_space(new_space)
    reg.register_pair(new_pair)
    assert reg.version() == v0 + 2
    reg.register_pair(new_pair)  # identical: no change, no bump
    assert reg.version() == v0 + 2
    assert reg.resolve("p1", "tuned-model", "bundle-fp") == (PAIR, SPACE)
    assert reg.resolve("p1", "tuned-model", "bundle-fp-2") == (new_pair, new_space)
    assert reg.revoke("sp", "bundle-fp") == [SPACE.ident, PAIR.ident]
    assert reg.version() > v0 + 2
    with pytest.raises(NotRegistered):
        reg.resolve("p1", "tuned-model", "bundle-fp")
    assert reg.resolve("p1", "tuned-model", "bundle-fp-2") == (new_pair, new_space)
    assert reg.revoke("p1") == [new_pair.ident]
    assert [p for p in reg.pairs() if p.pair_id == "p1"] == []
    assert [s for s in reg.spaces() if s.space_id == "sp"] == [new_space]
    assert reg.revoke("nothing") == []


def test_generations_coexist_and_revocation_bumps_the_version(tmp_path) -> None:
    check_generations_and_revocation(FileRegistry(tmp_path / "r.json"))


def test_records_of_an_older_registry_format_are_left_out(tmp_path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"spaces": {"sp": {"space_id": "sp"}}, "pairs": {"p1": {"pair_id": "p1"}}}))
    reg = FileRegistry(path)
    assert reg.spaces() == [] and reg.pairs() == []
    reg.register_space(SPACE)
    assert reg.spaces() == [SPACE]


def test_malformed_file_and_records(tmp_path) -> None:
    path = tmp_path / "r.json"
    path.write_text("[1, 2]")
    with pytest.raises(RegistryError, match="malformed"):
        FileRegistry(path).spaces()
    with pytest.raises(RegistryError):
        Space("sp", "", "x", "y")
    with pytest.raises(ValueError):
        Space("bad:id", "m", "x", "y")


def test_atomic_write_leaves_no_temp_files(tmp_path) -> None:
    reg = open_registry(path=tmp_path / "r.json")
    for i in range(5):
        reg.register_space(Space(f"s{i}", "m", "f", "b"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.json.lock"]
    assert len(reg.spaces()) == 5


def test_the_registry_directory_is_made_private_and_a_writable_one_refused(tmp_path) -> None:
    """Whoever may write the registry's directory can swap the file (un-revoke a pair, register a space)."""
    import os
    import stat

    from scd_store.store.fs_safety import UnsafePath

    reg = FileRegistry(tmp_path / "new" / "deeper" / "r.json")
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "deeper").st_mode) == 0o700
    reg.register_space(SPACE)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # world-writable, as /tmp without the sticky bit
    with pytest.raises(UnsafePath, match="registry directory"):
        FileRegistry(shared / "r.json")
    os.chmod(shared, 0o775)  # group-writable
    with pytest.raises(UnsafePath, match="registry directory"):
        FileRegistry(shared / "r.json")


def test_a_registry_file_others_may_write_is_refused(tmp_path) -> None:
    import os

    from scd_store.store.fs_safety import UnsafePath

    path = tmp_path / "r.json"
    reg = FileRegistry(path)
    reg.register_space(SPACE)
    assert reg.space("sp", "bundle-fp") == SPACE
    os.chmod(path, 0o666)  # someone made it writable for everyone: refused at once and on every read
    with pytest.raises(UnsafePath, match="registry file"):
        FileRegistry(path)
    with pytest.raises(UnsafePath, match="registry file"):
        reg.space("sp", "bundle-fp")
    with pytest.raises(UnsafePath, match="registry file"):
        reg.register_space(Space("s2", "m", "f", "b"))
    os.chmod(path, 0o620)  # group-writable
    with pytest.raises(UnsafePath, match="registry file"):
        reg.version()
    os.chmod(path, 0o644)  # others may read it: a registry is not secret
    assert reg.space("sp", "bundle-fp") == SPACE


def test_canaries_are_kept_per_space(tmp_path) -> None:
    reg = FileRegistry(tmp_path / "r.json")
    reg.record_canary("sp", "vllm", {"value": "a"})
    reg.record_canary("sp2", "vllm", {"value": "b"})
    reg.record_canary("sp", "vllm", {"value": "c"})  # replaces its own
    assert reg.canaries("sp") == {"vllm": {"value": "c"}} and reg.canaries("sp2") == {"vllm": {"value": "b"}}


@pytest.mark.parametrize("damage", [{"chunk_size": 1.5}, {"chunk_size": True}, {"chunk_size": 0},
                                    {"raw_kv_bytes_per_token": -1}, {"codec_id": 7}, {"surprise": 1},
                                    {"producer_model_id": ""}])
def test_a_malformed_space_record_is_as_good_as_absent(tmp_path, damage) -> None:
    """A record the registry's writer damaged (or a planted one) is a refusal, never an exception into the engine."""
    from scd_store.store.records import NotRegistered, Space
    from scd_store.store.registry import FileRegistry

    registry = FileRegistry(tmp_path / "reg" / "registry.json")
    space = registry.register_space(Space("sp", "prod", "pfp", "sfp"))
    data = json.loads(registry.path.read_text())
    data["spaces"][space.ident].update(damage)
    registry.path.write_text(json.dumps(data))
    with pytest.raises(NotRegistered, match="malformed"):
        registry.authorize_write("sp", "prod", "sfp")


def test_a_revocation_whose_version_bump_failed_is_seen_once_it_is_run_again(tmp_path) -> None:
    """Records removed, then the bump failed (a dropped connection, Redis out of memory): running the revoke
    again removes nothing but still bumps, so running stores re-read their answers."""
    from scd_store.store.records import Space
    from scd_store.store.registry import FileRegistry

    class FlakyBump(FileRegistry):
        fail = False

        def _bump_version(self) -> None:
            if self.fail:
                raise ConnectionError("the bump did not reach the registry")
            super()._bump_version()

    registry = FlakyBump(tmp_path / "reg" / "registry.json")
    registry.register_space(Space("sp", "prod", "pfp", "sfp"))
    seen = registry.version()
    registry.fail = True
    with pytest.raises(ConnectionError):
        registry.revoke("sp")
    registry.fail = False
    assert registry.revoke("sp") == []  # nothing left to remove
    assert registry.version() > seen + 1  # the removal's own bump and the retry's
