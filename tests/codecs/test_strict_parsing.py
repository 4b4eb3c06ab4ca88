"""Hostile numbers in payload headers, and payloads of another token count than expected.

Every numeric field of a tensor pack's header and of each codec's metadata, set to ``Infinity``,
``NaN``, ``1e400``, ``2.5``, ``true``, ``"7"`` (or its own value as a float, which ``int()`` would
accept), is a :class:`PayloadError`: never an OverflowError / TypeError into the engine, never a
coerced value. A payload claiming another token count than ``expect_tokens`` is refused as soon as
its header is read, before anything sized by its count is allocated.
"""

from __future__ import annotations

import json

import pytest
import torch

from scd_store.codecs import baselines
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.registry import make_codec
from scd_store.codecs.scd import space as space_module
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.tensor_pack import PayloadError, json_int, json_number, pack, strict_json, unpack
from tests.bundles import LAYOUT, correlated_state, tiny_space
from tests.codecs.hostile import HOSTILE, hostile_variants, pack_header, with_pack_field

TOKENS = 8


def _scd() -> ScdCodec:
    space = tiny_space(0.4, "strict", 2, "prod-fp")
    g, c = LAYOUT.groups, LAYOUT.width
    return ScdCodec(space, PairDecoder("c", space.fingerprint, torch.zeros(g, c, c), torch.zeros(g, c)),
                    cuda_graphs=False)


def _demo_pack() -> bytes:
    return pack("demo", {"a": 1}, {"x": torch.arange(6, dtype=torch.float32).view(2, 3),
                                   "y": torch.ones(4, dtype=torch.float16)})


# ------------------------------------------------------------------ the JSON helpers
@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "[1e400]", '{"a": -1e999}', "[" * 100_000])
def test_strict_json_refuses_non_finite_numbers_and_deep_nesting(text):
    with pytest.raises((ValueError, RecursionError)):
        strict_json(text)
    assert strict_json('{"a": [1, 2.5, -3e10]}') == {"a": [1, 2.5, -3e10]}


@pytest.mark.parametrize("value", [2.5, 8.0, True, False, "7", None, [1], float("inf"), float("nan")])
def test_json_int_never_coerces(value):
    with pytest.raises(PayloadError, match="must be an integer"):
        json_int(value, "x")
    assert json_int(7, "x") == 7 and json_int(-(10**30), "x") == -(10**30)


@pytest.mark.parametrize("value", [True, "7", None, [1.0], float("inf"), float("nan"), 10**400])
def test_json_number_takes_finite_numbers_only(value):
    with pytest.raises(ValueError, match="finite number"):
        json_number(value, "x", ValueError)
    assert json_number(10000, "x") == 10000.0 and json_number(2.5, "x") == 2.5


def test_pack_refuses_to_write_what_unpack_would_refuse():
    with pytest.raises(ValueError):
        pack("demo", {"x": float("nan")}, {})
    with pytest.raises(ValueError):
        pack("demo", {"x": [float("inf")]}, {})


# ------------------------------------------------------------------ the tensor pack's own header
PACK_FIELDS = [("tensors", 0, "offset"), ("tensors", 0, "nbytes"), ("tensors", 0, "shape", 0),
               ("tensors", 0, "shape", 1), ("tensors", 1, "offset"), ("tensors", 1, "nbytes"),
               ("tensors", 1, "shape", 0)]


@pytest.mark.parametrize("path", PACK_FIELDS, ids=lambda p: ".".join(map(str, p)))
def test_every_numeric_field_of_a_tensor_pack_refuses_hostile_numbers(path):
    payload = _demo_pack()
    value = pack_header(payload)
    for step in path:
        value = value[step]
    assert unpack(with_pack_field(payload, path, str(value)))[0] == "demo"  # the rewrite itself is sound
    for token in hostile_variants(value):
        hostile = with_pack_field(payload, path, token)
        with pytest.raises(PayloadError):
            unpack(hostile)
        with pytest.raises(PayloadError):  # the device path (a GPU tier's blob) parses the same header
            unpack(torch.frombuffer(bytearray(hostile), dtype=torch.uint8))


@pytest.mark.parametrize("token", HOSTILE[:5])
def test_non_finite_numbers_anywhere_in_the_header_are_refused(token):
    with pytest.raises(PayloadError, match="malformed header"):
        unpack(with_pack_field(_demo_pack(), ("meta", "a"), token))


@pytest.mark.parametrize("token", ["{}", '"2,3"', "[[2],[3]]", json.dumps([1] * 9), "3"])
def test_a_shape_that_is_no_list_of_integers_is_refused(token):
    with pytest.raises(PayloadError):
        unpack(with_pack_field(_demo_pack(), ("tensors", 0, "shape"), token))


def test_a_tensor_entry_that_is_no_object_is_refused():
    for token in ("7", '"x"', "[1, 2]", "null"):
        with pytest.raises(PayloadError):
            unpack(with_pack_field(_demo_pack(), ("tensors", 0), token))


# ------------------------------------------------------------------ codec metadata
@pytest.mark.parametrize("start", [0, 8])  # 0: the payload carries sink tokens; 8: it does not
@pytest.mark.parametrize("field", ["start", "tokens", "sinks"])
def test_every_count_of_an_scd_payload_refuses_hostile_numbers(field, start):
    codec = _scd()
    payload = codec.encode(correlated_state(TOKENS, start=start, seed=1))
    value = pack_header(payload)["meta"][field]
    buffers = torch.full((2, 2, TOKENS, 8), float("nan")), torch.full((2, 2, TOKENS, 8), float("nan"))
    for token in hostile_variants(value):
        hostile = with_pack_field(payload, ("meta", field), token)
        with pytest.raises(PayloadError):
            codec.decode(hostile)
        with pytest.raises(PayloadError):
            codec.decode_into(hostile, *buffers)
        with pytest.raises(PayloadError):
            codec.decode(torch.frombuffer(bytearray(hostile), dtype=torch.uint8))
    assert buffers[0].isnan().all() and buffers[1].isnan().all()  # nothing was written into the engine's buffers


@pytest.mark.parametrize("path", [("meta", "bits"), ("meta", "shape", 0), ("meta", "shape", 2), ("meta", "shape", 3)],
                         ids=lambda p: ".".join(map(str, p)))
@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_every_field_of_a_kivi_payload_refuses_hostile_numbers(name, path):
    codec = make_codec(name)
    payload = codec.encode(correlated_state(TOKENS, seed=2))
    value = pack_header(payload)
    for step in path:
        value = value[step]
    for token in hostile_variants(value):
        with pytest.raises(PayloadError):
            codec.decode(with_pack_field(payload, path, token))


@pytest.mark.parametrize("token", ["{}", '"2,2,8,8"', "[2, 2, 8]", "[2, 2, -8, 8]", "null"])
def test_a_kivi_shape_that_is_no_four_integers_is_refused(token):
    codec = make_codec("int8")
    with pytest.raises(PayloadError):
        codec.decode(with_pack_field(codec.encode(correlated_state(TOKENS, seed=2)), ("meta", "shape"), token))


def test_kivi_payload_tensors_of_too_few_dimensions_are_refused():
    codec = make_codec("int8")
    tensors = {name: torch.zeros(3, dtype=torch.uint8 if "codes" in name else torch.float16)
               for name in ("k_codes", "k_scale", "k_offset", "v_codes", "v_scale", "v_offset")}
    with pytest.raises(PayloadError):
        codec.decode(pack("int8", {"shape": [2, 2, 3, 8], "bits": 8}, tensors))


# ------------------------------------------------------------------ the token count, bounded before allocation
CODECS = ["raw", "raw-bf16", "int8", "int4", "int2", "scd"]


def _codec(name: str):
    return _scd() if name == "scd" else make_codec(name)


@pytest.mark.parametrize("name", CODECS)
def test_every_codec_refuses_another_token_count_than_expected(name):
    codec = _codec(name)
    state = correlated_state(TOKENS, start=4, seed=3)
    payload = codec.encode(state)
    fresh = codec.decode(payload)
    same = codec.decode(payload, expect_tokens=TOKENS)
    assert torch.equal(same.keys, fresh.keys) and same.num_tokens == TOKENS
    for expect in (TOKENS - 1, TOKENS + 1, 0):
        with pytest.raises(PayloadError, match=f"claims {TOKENS} tokens, {expect} were expected"):
            codec.decode(payload, expect_tokens=expect)
        keys, values = torch.full_like(state.keys, float("nan")), torch.full_like(state.values, float("nan"))
        with pytest.raises(PayloadError):
            codec.decode_into(payload, keys, values, expect_tokens=expect)
        assert keys.isnan().all() and values.isnan().all()
    keys, values = torch.empty_like(state.keys), torch.empty_like(state.values)
    out = codec.decode_into(payload, keys, values, expect_tokens=TOKENS)
    assert out.keys is keys and torch.equal(keys, fresh.keys)


def test_an_scd_payload_of_another_count_is_refused_before_its_codes_are_unpacked(monkeypatch):
    """The refusal comes from the header: no section is unpacked, no output is allocated."""
    codec = _scd()
    payload = codec.encode(correlated_state(4 * TOKENS, start=8, seed=4))  # a real payload of 32 tokens
    calls = []
    real_unpack = space_module.unpack_sorted
    monkeypatch.setattr(space_module, "unpack_sorted", lambda *a: calls.append("unpack") or real_unpack(*a))
    real_decode = ScdCodec.decode_codes
    monkeypatch.setattr(ScdCodec, "decode_codes", lambda *a, **k: calls.append("decode") or real_decode(*a, **k))
    small = torch.empty(2, 2, TOKENS, 8), torch.empty(2, 2, TOKENS, 8)
    with pytest.raises(PayloadError, match="claims 32 tokens, 8 were expected"):
        codec.decode(payload, expect_tokens=TOKENS)
    with pytest.raises(PayloadError, match="claims 32 tokens, 8 were expected"):
        codec.decode_into(payload, *small, expect_tokens=TOKENS)
    with pytest.raises(PayloadError, match="decodes to 32 tokens; the buffers hold 8"):  # the buffers bound it too
        codec.decode_into(payload, *small)
    assert calls == []
    assert codec.decode(payload, expect_tokens=4 * TOKENS).num_tokens == 4 * TOKENS and calls == ["unpack", "decode"]


def test_a_kivi_payload_of_another_count_is_refused_before_dequantising(monkeypatch):
    codec = make_codec("int8")
    payload = codec.encode(correlated_state(4 * TOKENS, seed=5))
    calls = []
    monkeypatch.setattr(baselines, "dequantize", lambda *a: calls.append(a))
    with pytest.raises(PayloadError, match="claims 32 tokens"):
        codec.decode(payload, expect_tokens=TOKENS)
    assert calls == []


def test_a_raw_payload_holding_no_kv_is_refused():
    codec = make_codec("raw")
    with pytest.raises(PayloadError):
        codec.decode(pack("raw", {}, {"keys": torch.zeros(3, dtype=torch.float16),
                                      "values": torch.zeros(3, dtype=torch.float16)}), expect_tokens=3)
    with pytest.raises(PayloadError):
        codec.decode(pack("raw", {}, {"keys": torch.zeros(1, 1, 3, 2, dtype=torch.float16),
                                      "values": torch.zeros(1, 1, 4, 2, dtype=torch.float16)}))
    ok = KVState(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    assert codec.decode(codec.encode(ok), expect_tokens=3).num_tokens == 3
