"""Bindings: each engine model name is a producer, a consumer through its pair, or nothing."""

from __future__ import annotations

import pytest

from scd_store.codecs.scd.codec import ScdCodec
from scd_store.service.bindings import Binding, Bindings, ServiceError, pair_id_for
from tests.bundles import tiny_space


def test_aliases_resolve_and_a_model_binds_once():
    space = tiny_space()
    bindings = Bindings({"served/name": "producer-a"})
    bindings.add(Binding("producer-a", "producer", space, ScdCodec(space)))
    assert bindings.get("served/name") is bindings.get("producer-a") and bindings.get("stranger") is None
    assert bindings.roles() == {"producer-a": "producer"}
    with pytest.raises(ServiceError, match="bound twice"):
        bindings.add(Binding("producer-a", "producer", space, ScdCodec(space)))


def test_a_binding_checks_its_role_and_pair():
    space = tiny_space()
    assert pair_id_for("tiny-space", "c") == "tiny-space/c"
    with pytest.raises(ServiceError, match="role"):
        Binding("m", "reader", space, ScdCodec(space))
    with pytest.raises(ServiceError, match="pair id"):
        Binding("m", "consumer", space, ScdCodec(space))
