"""``SCD_STORE_GLIBC_MMAP`` follows the one rule for booleans; a value that is neither is logged and ignored."""

from __future__ import annotations

import logging

import pytest

from scd_store.cli.allocator import glibc_default_wanted


@pytest.mark.parametrize("value, wanted", [(None, False), ("1", True), ("yes", True), ("ON", True), ("0", False),
                                           ("false", False), ("off", False)])
def test_true_keeps_glibcs_default_and_unset_or_false_reuses_blocks(value, wanted, caplog):
    with caplog.at_level(logging.WARNING, logger="scd_store.cli"):
        assert glibc_default_wanted(value) is wanted
    assert not caplog.records


@pytest.mark.parametrize("value", ["maybe", "", "2"])
def test_anything_else_is_logged_and_blocks_are_reused(value, caplog):
    with caplog.at_level(logging.WARNING, logger="scd_store.cli"):
        assert glibc_default_wanted(value) is False
    assert "SCD_STORE_GLIBC_MMAP must be true or false" in caplog.text and "ignored" in caplog.text
