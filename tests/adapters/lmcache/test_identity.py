"""Who an LMCache chunk belongs to: its model (or the adapter a request names) and its tenant tags."""

from __future__ import annotations

import types

from scd_store.adapters.lmcache.identity import ChunkIdentity, batch_identity, key_identity
from scd_store.adapters.lmcache.layout import chunk_hash_bytes


def key(model="base", **tags):
    return types.SimpleNamespace(model_name=model, request_configs={f"lmcache.tag.{k}": v for k, v in tags.items()})


def test_tags_are_the_namespace_and_the_model_tag_names_the_model():
    assert key_identity(key()) == ChunkIdentity("base")
    assert key_identity(key(tenant="acme")) == ChunkIdentity("base", (("tenant", "acme"),))
    assert key_identity(key(scd_model="adapter-1", tenant="acme")) == ChunkIdentity("adapter-1", (("tenant", "acme"),))


def test_an_engine_that_serves_adapters_cannot_attribute_untagged_requests():
    assert key_identity(key(), serves_adapters=True).model is None
    assert key_identity(key(scd_model="base"), serves_adapters=True).model == "base"
    assert batch_identity([key(scd_model="a"), key(scd_model="b")]).model is None  # a mixed batch: nobody's


def test_other_tags_are_other_store_hashes():
    assert chunk_hash_bytes(7) != chunk_hash_bytes(7, (("tenant", "acme"),)) != chunk_hash_bytes(
        7, (("tenant", "globex"),))
    assert chunk_hash_bytes(7, (("a", "1"), ("b", "2"))) == chunk_hash_bytes(7, (("b", "2"), ("a", "1")))
