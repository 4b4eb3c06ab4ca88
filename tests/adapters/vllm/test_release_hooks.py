"""The connector hooks vLLM 0.33 / 0.34 added: ``may_load_async`` (loads that may start before the batch has room),
cache-hit sources (each loaded token labelled with the tier that held it), and sleep mode (declined). vLLM 0.32 calls
none of them; the ones that need 0.34's own classes skip on 0.32 with that reason."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from scd_store.adapters.vllm.connector import ScdConnector  # noqa: E402
from scd_store.adapters.vllm.hit_sources import token_sources  # noqa: E402
from scd_store.service import Lookup  # noqa: E402
from tests.adapters.vllm.vllm_scheduler import CHUNK, engine  # noqa: E402


def test_tokens_are_labelled_by_the_tier_that_held_their_chunk():
    tiers = ("cpu", "disk", "redis", "peer", "gpu")
    assert token_sources(tiers, 32, 0, 160) == {"host": 32, "disk": 32, "external_unspecified": 32, "p2p": 32,
                                                "device": 32}
    assert token_sources(tiers, 32, 40, 96) == {"disk": 24, "external_unspecified": 32}  # a hit past vLLM's own
    assert token_sources((), 32, 0, 64) == {"external_unspecified": 64}
    assert token_sources(("cpu", "mystery"), 32, 0, 64) == {"host": 32, "external_unspecified": 32}


def test_may_load_async_answers_for_registered_consumers_without_a_lookup(tmp_path):
    asked = []
    eng = engine(tmp_path, lambda model, hashes: asked.append(model) or Lookup(0), lambda *a: 0, role="consumer")
    connector = eng.scheduler.connector
    connector.async_loads = True
    request = eng.add("c")
    assert connector.may_load_async(request) and asked == []  # cheap: answered without a lookup
    connector.async_loads = False
    assert not connector.may_load_async(request)
    producer = engine(tmp_path / "p", lambda *a: Lookup(0), lambda *a: 0, role="producer")
    producer.scheduler.connector.async_loads = True
    assert not producer.scheduler.connector.may_load_async(producer.add("p"))


def test_loaded_tokens_reach_vllm_labelled_by_tier(tmp_path):
    cache_hit_source = pytest.importorskip("vllm.v1.metrics.cache_hit_source",
                                           reason="vLLM 0.33+ labels cache hits by source; 0.32 does not ask")
    eng = engine(tmp_path, lambda model, hashes: Lookup(3, 0, ("cpu", "disk", "cpu")), lambda load, gate=None:
                 3 * CHUNK, role="consumer")
    connector = eng.scheduler.connector
    request = eng.add("c")
    matched, _ = connector.get_num_new_matched_tokens(request, 0)
    assert matched == 3 * CHUNK
    connector._scheduler.after_alloc(request, list(range(7)), matched)
    sources = connector.get_external_cache_hit_sources(request, matched)
    source = cache_hit_source.CacheHitSource
    assert sources == {source.HOST: 2 * CHUNK, source.DISK: CHUNK} and sum(sources.values()) == matched
    assert connector.get_external_cache_hit_sources(request, matched) == {source.EXTERNAL_UNSPECIFIED: matched}


def test_sleep_mode_is_declined():
    assert ScdConnector.supports_sleep_mode(types.SimpleNamespace()) is False
