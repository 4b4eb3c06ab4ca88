"""Who an LMCache chunk belongs to: roles come from the engine; tags are tenants (and, on an engine
that serves adapters, the consumer a gateway names)."""

from __future__ import annotations

import types

from scd_store.adapters.lmcache.identity import ChunkIdentity, batch_identity, key_identity
from scd_store.adapters.lmcache.layout import chunk_hash_bytes


def key(model="base", **tags):
    return types.SimpleNamespace(model_name=model, request_configs={f"lmcache.tag.{k}": v for k, v in tags.items()})


def adapters(name: str) -> bool:  # the engine's space has one registered consumer
    return name == "adapter-1"


def test_tags_are_the_namespace_and_the_model_is_the_engines():
    assert key_identity(key()) == ChunkIdentity("base")
    assert key_identity(key(tenant="acme")) == ChunkIdentity("base", (("tenant", "acme"),))


def test_a_model_tag_on_an_engine_without_adapters_is_ignored_and_never_a_namespace():
    """The attack: a consumer engine's client tags its request with the producer's name."""
    tagged = key_identity(key("consumer", scd_model="base", tenant="acme"), is_adapter=lambda _: True)
    assert tagged == ChunkIdentity("consumer", (("tenant", "acme"),), ignored_tag="base")
    assert key_identity(key("consumer", scd_model="base")).namespace == key_identity(key("consumer")).namespace == ()
    assert key_identity(key("base", scd_model="base")) == ChunkIdentity("base")  # its own name: nothing ignored
    aliased = key_identity(key("/ckpt/base", scd_model="base"), aliases={"/ckpt/base": "base"})
    assert aliased == ChunkIdentity("/ckpt/base")  # the same model by its bundle name


def test_an_engine_that_serves_adapters_attributes_only_its_registered_consumers():
    def identity(**tags):
        return key_identity(key("base", **tags), serves_adapters=True, is_adapter=adapters)

    assert identity(scd_model="adapter-1", tenant="acme") == ChunkIdentity("adapter-1", (("tenant", "acme"),))
    assert identity().model is None  # untagged: which model? unknown
    assert identity(scd_model="base").model is None  # the producer: never attributed (it would write)
    assert identity(scd_model="stranger").model is None
    assert batch_identity([key(scd_model="a"), key(scd_model="b")]).model is None  # a mixed batch: nobody's


def test_a_salt_tag_marks_the_chunk_salted_and_leaves_the_namespace():
    salted = key_identity(key(scd_cache_salt="ab12", tenant="acme"))
    assert salted == ChunkIdentity("base", (("tenant", "acme"),), salted=True)
    assert key_identity(key(scd_cache_salt="ab12", scd_model="adapter-1"), serves_adapters=True,
                        is_adapter=adapters).salted
    mixed = batch_identity([key(scd_cache_salt="ab12"), key()])
    assert mixed.model is None and mixed.salted


def test_other_tags_are_other_store_hashes():
    assert chunk_hash_bytes(7) != chunk_hash_bytes(7, (("tenant", "acme"),)) != chunk_hash_bytes(
        7, (("tenant", "globex"),))
    assert chunk_hash_bytes(7, (("a", "1"), ("b", "2"))) == chunk_hash_bytes(7, (("b", "2"), ("a", "1")))
