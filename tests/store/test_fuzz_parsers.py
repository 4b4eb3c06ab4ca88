"""Mutation fuzzing of every parser that reads stored or transferred bytes (100,000 inputs each).

A parser either returns a value or raises its own error type; nothing else (no IndexError, no
struct.error, no garbage). The soak run (`scd-store bench soak`) runs the same fuzzers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scd_store.bench.fuzz import TARGETS, fuzz, seed_blob
from scd_store.codecs.scd.bundle import BundleError, parse_manifest
from scd_store.store.blob import BlobError, decode_blob

INPUTS = 100_000


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_parser_survives_100k_mutations(name):
    parse, error, make_seed = TARGETS[name]
    seed_input = make_seed()
    accepted, refused = fuzz(parse, error, seed_input, INPUTS)
    assert len(accepted) + refused == INPUTS
    if name == "blob":
        assert all(data == seed_input for data in accepted)  # only mutations that changed nothing pass
    else:
        assert refused > INPUTS // 4


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=512))
def test_blob_parser_on_arbitrary_bytes(data):
    with pytest.raises(BlobError):
        decode_blob(seed_blob()[:20] + data)


@pytest.mark.parametrize("bad", [b"[]", b'"x"', b"null", b'{"format": "scd-bundle", "kind": "space"}',
                                 b'{"format": "scd-bundle", "kind": "space", "format_version": "1"}',
                                 b'{"format": "scd-bundle", "kind": "space", "format_version": 2}'])
def test_manifest_errors_name_the_problem(bad):
    with pytest.raises(BundleError):
        parse_manifest(bad, "space")
