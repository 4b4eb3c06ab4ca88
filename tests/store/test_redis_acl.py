"""The Redis ACL recipe: the documented lines are the ones the code makes (and the roles test runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scd_store.store.redis_acl import acl_setuser, recipe


def test_the_documented_recipe_is_the_tested_one() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    assert recipe("SPACE") in page, "docs/reliability.md: paste scd_store.store.redis_acl.recipe('SPACE')"


def test_roles_are_checked() -> None:
    with pytest.raises(ValueError, match="role"):
        acl_setuser("admin", "u", "p")
    with pytest.raises(ValueError, match="space id"):
        acl_setuser("producer", "u", "p")
    with pytest.raises(ValueError, match="space id"):
        acl_setuser("consumer", "u", "p", "sp")
    consumer = acl_setuser("consumer", "u", "p")
    assert "+set" not in consumer and "+del" not in consumer and "+hsetnx" not in consumer
    assert "~scd:sp:*" in acl_setuser("producer", "u", "p", "sp")


def test_no_consumer_command_can_change_a_blob_or_fill_the_blobs_instance() -> None:
    """Static half of integration_tests/test_redis_roles.py (which plays each command on a real server): the
    consumer may write no key at all in the blobs' instance (its reports are published, never stored), and it
    holds no selector (the old one let ``PEXPIRE key 0`` delete any blob)."""
    consumer = acl_setuser("consumer", "u", "p")
    writable = [a for a in consumer if a.startswith("~") or a.startswith("%W") or a.startswith("%RW")]
    assert writable == [] and "%R~scd:*" in consumer and not any(a.startswith("(") for a in consumer)
    assert "&scd:__reports__:*" in consumer and "+publish" in consumer and "+subscribe" not in consumer
    for command in ("+pexpire", "+persist", "+del", "+unlink", "+set", "+hdel", "+getex", "+getdel", "+rename",
                    "+hset", "+hincrby", "+expire", "+lpush", "+xadd", "+setbit"):
        assert command not in consumer
    producer = acl_setuser("producer", "u", "p", "sp")
    assert "~scd:__registry__:canaries:sp" in producer and "%W~scd:__registry__:canaries" not in producer
    assert "+hkeys" not in producer and "+hscan" in producer and "~scd:__stats__*" not in " ".join(producer)
    assert "&scd:__reports__:sp:*" in producer and "+subscribe" in producer and "+publish" not in producer
    with pytest.raises(ValueError, match="space id"):
        acl_setuser("producer", "u", "p", "*")  # a glob would reach every space
    stats = acl_setuser("stats", "u", "p")
    assert [a for a in stats if a.startswith("~")] == ["~scd:__stats__*"] and "+set" not in stats
