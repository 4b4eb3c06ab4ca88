"""One rule for booleans given as text."""

from __future__ import annotations

import pytest

from scd_store.flags import parse_flag


@pytest.mark.parametrize("text, value", [("1", True), ("TRUE", True), ("yes", True), (" on ", True), ("0", False),
                                         ("False", False), ("no", False), ("off", False), (True, True),
                                         (False, False), (1, True), (0, False)])
def test_the_words_for_true_and_false(text, value):
    assert parse_flag(text) is value


@pytest.mark.parametrize("text", ["", "flase", "2", "y", None, 2, -1, 0.0, 1.0])
def test_anything_else_is_an_error_naming_the_setting(text):
    with pytest.raises(ValueError, match="serves_adapters must be true or false"):
        parse_flag(text, "serves_adapters")
