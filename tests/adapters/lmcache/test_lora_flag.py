"""SCD_STORE_ENGINE_SERVES_LORA, the vLLM connector's word to the LMCache plugin, reads as a flag; other values
are refused (never a guess about whether an engine may write codes)."""

from __future__ import annotations

import pytest

pytest.importorskip("lmcache", reason="the LMCache stack is installed by `make test`")

from scd_store.adapters.lmcache.plugin import engine_serves_lora  # noqa: E402
from scd_store.service import SettingsError  # noqa: E402


@pytest.mark.parametrize("value", ["1", "true", "Yes", "on"])
def test_a_true_flag_says_the_engine_serves_adapters(monkeypatch, value):
    monkeypatch.setenv("SCD_STORE_ENGINE_SERVES_LORA", value)
    assert engine_serves_lora()


@pytest.mark.parametrize("value", ["0", "false", "off", "", "  "])
def test_a_false_flag_leaves_it_to_the_engine_config(monkeypatch, value):
    monkeypatch.setenv("SCD_STORE_ENGINE_SERVES_LORA", value)
    assert not engine_serves_lora()  # no vLLM config in force here


def test_a_value_that_is_no_flag_is_refused(monkeypatch):
    monkeypatch.setenv("SCD_STORE_ENGINE_SERVES_LORA", "maybe")
    with pytest.raises(SettingsError, match="SCD_STORE_ENGINE_SERVES_LORA"):
        engine_serves_lora()
