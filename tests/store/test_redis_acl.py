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
