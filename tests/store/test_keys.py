from __future__ import annotations

import hashlib

import numpy as np
import pytest

from scd_store.store.keys import (
    ROOT_HASH,
    KeyError_,
    StoreKey,
    chunk_hashes,
    generation_of,
    hash_keys,
    make_key,
    parse_key,
    scope_of,
    space_of,
    validate_space_id,
)


def test_chain_matches_definition() -> None:
    tokens = list(range(10))
    hashes = chunk_hashes(tokens, 4)
    assert len(hashes) == 2  # the trailing partial chunk (2 tokens) has no key
    assert hashlib.sha256(b"scd-store/chunk-chain/v2").digest()[:16] == ROOT_HASH
    h1 = hashlib.sha256(ROOT_HASH + np.arange(4, dtype="<i8").tobytes()).digest()[:16]
    h2 = hashlib.sha256(h1 + np.arange(4, 8, dtype="<i8").tobytes()).digest()[:16]
    assert hashes == [h1, h2]


def test_prefix_property_and_parent_dependence() -> None:
    a = chunk_hashes(list(range(12)), 4)
    b = chunk_hashes(list(range(8)) + [99, 100, 101, 102], 4)
    assert a[:2] == b[:2] and a[2] != b[2]
    # the same chunk after a different parent gets a different hash
    c = chunk_hashes([7, 7, 7, 7] + list(range(4, 8)), 4)
    assert c[1] != a[1]


def test_stable_across_input_types() -> None:
    tokens = [5, 1, 2, 3, 4, 0, 9, 8]
    expected = chunk_hashes(tokens, 4)
    assert chunk_hashes(np.array(tokens, dtype=np.int32), 4) == expected
    assert chunk_hashes(tuple(tokens), 4) == expected
    assert chunk_hashes(np.array(tokens, dtype=np.uint16), 4) == expected


def test_key_format_and_parse() -> None:
    generation = generation_of("fp-1")
    keys = hash_keys("space.1", generation, chunk_hashes(list(range(512))))
    assert len(keys) == 2 and generation.startswith("v3.") and len(generation) == 19
    for key in keys:
        space, gen, hex_ = parse_key(key)
        assert key == f"scd:space.1:{generation}:{hex_}" and space == "space.1" and len(hex_) == 32
        assert gen == generation
    assert make_key("space.1", generation, bytes.fromhex(parse_key(keys[0])[2])) == keys[0]


def test_a_parsed_key_names_its_parts() -> None:
    generation = generation_of("fp-1")
    key = make_key("space.1", generation, "ab" * 16)
    parsed = parse_key(key)
    assert isinstance(parsed, StoreKey) and parsed == ("space.1", generation, "ab" * 16)
    assert (parsed.space_id, parsed.generation, parsed.chunk_hex) == ("space.1", generation, "ab" * 16)
    assert parsed.scope == scope_of("space.1", generation) == f"space.1:{generation}"
    assert make_key(*parsed) == key


@pytest.mark.parametrize("key", ["scd:sp:xyz", "scd:a:b:" + "0" * 32, "", "a:b:c:d", None])
def test_the_space_of_a_malformed_key_is_empty(key) -> None:
    assert space_of(key) == ""


def test_the_space_of_a_key() -> None:
    assert space_of(make_key("space.1", generation_of("fp"), b"\x01" * 16)) == "space.1"


def test_generations_never_share_keys() -> None:
    """Two bundle generations of a space (and two blob formats) key the same chunk differently."""
    hashes = chunk_hashes(list(range(256)))
    old, new = (hash_keys("sp", generation_of(fp), hashes) for fp in ("fp-old", "fp-new"))
    assert old != new and hash_keys("sp", generation_of("fp-old", version=2), hashes) != old
    with pytest.raises(KeyError_):
        hash_keys("sp", "fp-old", hashes)  # a fingerprint is not a generation


@pytest.mark.parametrize("tokens", [[1, 2.5, 3, 4], ["a", "b"], [1, -1, 2, 3], [[1, 2], [3, 4]], "abcd", [2**70]])
def test_bad_tokens(tokens) -> None:
    with pytest.raises(KeyError_):
        chunk_hashes(tokens, 2)


@pytest.mark.parametrize("space", ["", "a:b", "-x", "x" * 129, "a b", 5, None])
def test_bad_space_ids(space) -> None:
    with pytest.raises(KeyError_):
        validate_space_id(space)


@pytest.mark.parametrize("key", ["scd:sp:xyz", "foo:sp:" + "0" * 32, "scd:sp", "scd:sp:" + "0" * 32,
                                 "scd:a:b:" + "0" * 32, "scd:a:v2.0123456789abcdef:" + "0" * 31,
                                 "scd:a\n:v3.0123456789abcdef:" + "0" * 32,
                                 "scd:a:v3.0123456789abcdef:" + "0" * 32 + "\n",
                                 "scd:a:v3.0123456789abcdef\n:" + "0" * 32])
def test_bad_keys(key) -> None:
    with pytest.raises(KeyError_):
        parse_key(key)


@pytest.mark.parametrize("chunk_hash", [b"short", b"x" * 17, "00" * 16, None])
def test_bad_chunk_hashes(chunk_hash) -> None:
    with pytest.raises(KeyError_):
        hash_keys("sp", generation_of("fp"), [chunk_hash])


def test_bad_chunk_size() -> None:
    with pytest.raises(KeyError_):
        chunk_hashes([1, 2], 0)
    assert chunk_hashes([], 4) == [] and chunk_hashes([1, 2, 3], 4) == []
