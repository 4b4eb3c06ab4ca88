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
PAIR = Pair("p1", "sp", "tuned-model", "tuned-fp", "pair-fp")


def test_register_and_resolve(tmp_path) -> None:
    reg = FileRegistry(tmp_path / "r.json")
    reg.register_space(SPACE)
    reg.register_pair(PAIR)
    again = FileRegistry(tmp_path / "r.json")  # another process reading the same file
    assert again.resolve("p1", "tuned-model") == (PAIR, SPACE)
    assert again.authorize_write("sp", "base-model") == SPACE
    assert [s.space_id for s in again.spaces()] == ["sp"] and [p.pair_id for p in again.pairs()] == ["p1"]
    assert json.loads((tmp_path / "r.json").read_text())["pairs"]["p1"]["space_id"] == "sp"


def test_errors_are_specific(tmp_path) -> None:
    reg = FileRegistry(tmp_path / "r.json")
    with pytest.raises(NotRegistered, match="code space 'sp' is not registered"):
        reg.register_pair(PAIR)
    reg.register_space(SPACE)
    reg.register_pair(PAIR)
    with pytest.raises(NotRegistered, match="pair 'p2'"):
        reg.resolve("p2", "tuned-model")
    with pytest.raises(NotRegistered, match="'other' is not registered for pair 'p1'"):
        reg.resolve("p1", "other")
    with pytest.raises(NotAuthorized, match="only its producer 'base-model'"):
        reg.authorize_write("sp", "tuned-model")


def test_conflicting_registration_needs_replace(tmp_path) -> None:
    reg = FileRegistry(tmp_path / "r.json")
    reg.register_space(SPACE)
    reg.register_space(SPACE)  # identical: idempotent
    changed = Space("sp", "base-model", "base-fp", "bundle-fp-2")
    with pytest.raises(RegistryError, match="already registered"):
        reg.register_space(changed)
    reg.register_space(changed, replace=True)
    assert reg.space("sp").fingerprint == "bundle-fp-2"


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
