"""The vLLM connector's word to the LMCache plugin that its engine serves LoRA adapters travels in this process's
memory (scd_store.service.engine_facts), never through the environment that child processes inherit."""

from __future__ import annotations

import pytest

pytest.importorskip("lmcache", reason="the LMCache stack is installed by `make test`")

from scd_store.adapters.lmcache.plugin import engine_serves_lora  # noqa: E402
from scd_store.service import engine_facts  # noqa: E402


def test_the_plugin_hears_the_connector_in_this_process_only(monkeypatch) -> None:
    monkeypatch.setattr(engine_facts, "_serves_lora", False)  # restored after the test
    monkeypatch.setenv("SCD_STORE_ENGINE_SERVES_LORA", "1")  # the old side channel: no longer read
    assert not engine_serves_lora()  # no vLLM config in force here, and nothing said
    engine_facts.mark_serves_lora()
    assert engine_serves_lora()
