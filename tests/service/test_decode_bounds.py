"""A stored payload is bounded by its blob header before it is decoded.

The blob header's token count is bounded by the store (a chunk of the space holds at most
``chunk_size`` tokens); a payload inside it that claims more (or other) tokens, or holds hostile
numbers, is a refused chunk from ``KVService.get``: counted, the run ends there, and nothing sized
by the payload's own claim is allocated or written into the engine's buffers.
"""

from __future__ import annotations

import pytest
import torch

from scd_store.codecs.paged import paged_caches
from scd_store.codecs.scd import space as space_module
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.service import KVService, PagedTargets
from tests.bundles import PRODUCER, correlated_state
from tests.codecs.hostile import hostile_variants, pack_header, with_pack_field
from tests.service.conftest import SERVED_HASHES

HASHES = SERVED_HASHES
PAIR = "tiny-space/consumer-a"


def _overwrite(service: KVService, payload: bytes, tokens: int = 8) -> None:
    """Chunk 1 := ``payload`` under a valid blob header of the space claiming ``tokens`` tokens."""
    space = service.binding(PRODUCER).space
    producer = service.store.producer(space.space_id, PRODUCER, space.fingerprint)
    assert producer.put([HASHES[1]], [payload], [tokens], codec_id=ScdCodec.codec_id)


@pytest.fixture
def spies(monkeypatch):
    """Record every unpacking of a payload's codes and every decode of unpacked codes."""
    calls: list[str] = []
    real_unpack, real_decode = space_module.unpack_sorted, ScdCodec.decode_codes
    monkeypatch.setattr(space_module, "unpack_sorted", lambda *a: calls.append("unpack") or real_unpack(*a))
    monkeypatch.setattr(ScdCodec, "decode_codes", lambda *a, **k: calls.append("decode") or real_decode(*a, **k))
    return calls


def _buffers():
    keys = torch.full((2, 2, 24, 8), float("nan"))
    values = torch.full_like(keys, float("nan"))
    asked = []

    def into(i: int, tokens: int):
        asked.append((i, tokens))
        return keys[:, :, 8 * i:8 * i + tokens], values[:, :, 8 * i:8 * i + tokens]

    return keys, values, asked, into


def _paged():
    """NaN-filled paged caches of the tiny model (two layers of 3 blocks x 8 slots) and targets naming chunk i's
    slots ``8 i ..``."""
    raw = [torch.full((3, 2, 8, 2, 8), float("nan")) for _ in range(2)]
    caches = paged_caches(raw)
    return raw, PagedTargets(caches, lambda i, tokens: torch.arange(8 * i, 8 * i + tokens, dtype=torch.int64))


def test_a_payload_claiming_more_tokens_than_its_blob_header_is_refused_before_it_is_decoded(service, spies):
    """A real 256-token payload (its codes all there) stored under an 8-token blob header: the decode
    refuses it from its header, before its codes are unpacked or any output is allocated for 256 tokens."""
    big = service.binding(PRODUCER).codec.encode(correlated_state(256, start=8, seed=7))
    _overwrite(service, big)
    got = service.get("consumer-a", HASHES)  # the SGLang path: no buffers, the codec allocates
    assert len(got) == 1 and got[0].num_tokens == 8  # chunk 0 decoded; the run ends at chunk 1
    assert spies == ["unpack", "decode"]  # chunk 0 only: chunk 1 was refused from its header
    assert service.store.stats.value("refused_chunks", pair=PAIR) == 1


def test_into_buffers_are_never_written_for_a_payload_claiming_more_tokens(service, spies):
    big = service.binding(PRODUCER).codec.encode(correlated_state(256, start=8, seed=7))
    _overwrite(service, big)
    keys, values, asked, into = _buffers()
    got = service.get("consumer-a", HASHES, into=into)
    assert len(got) == 1 and asked == [(0, 8), (1, 8)]  # chunk 2 is never asked for
    assert spies == ["unpack", "decode"]
    assert not keys[:, :, :8].isnan().any() and keys[:, :, 8:].isnan().all() and values[:, :, 8:].isnan().all()
    assert service.store.stats.value("refused_chunks", pair=PAIR) == 1


def test_a_payload_claiming_fewer_tokens_than_its_blob_header_is_refused_too(service, spies):
    fewer = service.binding(PRODUCER).codec.encode(correlated_state(5, start=8, seed=7))
    _overwrite(service, fewer)
    assert len(service.get("consumer-a", HASHES)) == 1 and spies == ["unpack", "decode"]
    assert service.store.stats.value("refused_chunks", pair=PAIR) == 1


def test_the_after_decode_check_still_refuses_a_codec_that_ignores_the_expectation(service, monkeypatch):
    """The second line of defence: a codec that decoded another count than the header's is still refused."""
    codec = service.binding("consumer-a").codec
    real = ScdCodec.decode
    monkeypatch.setattr(codec, "decode", lambda payload, **kw: real(codec, payload, **{**kw, "expect_tokens": None}))
    _overwrite(service, codec.encode(correlated_state(8, start=8, seed=7)), tokens=6)
    assert len(service.get("consumer-a", HASHES)) == 1
    assert service.store.stats.value("refused_chunks", pair=PAIR) == 1


@pytest.mark.parametrize("field", ["start", "tokens", "sinks"])
def test_hostile_numbers_in_a_stored_payload_are_refused_chunks_not_crashes(service, field):
    good = service.binding(PRODUCER).codec.encode(correlated_state(8, start=8, seed=7))
    value = pack_header(good)["meta"][field]
    keys, values, _, into = _buffers()
    for refused, token in enumerate(hostile_variants(value), start=1):
        _overwrite(service, with_pack_field(good, ("meta", field), token))
        assert len(service.get("consumer-a", HASHES)) == 1  # no OverflowError / TypeError out of the get
        assert len(service.get("consumer-a", HASHES, into=into)) == 1
        raw, targets = _paged()
        assert service.get_paged("consumer-a", HASHES, targets) == 1  # the slot-table path refuses it too
        assert all(c[1:].isnan().all() for c in raw)  # chunk 1's slots (block 1 on) never written
        assert service.store.stats.value("refused_chunks", pair=PAIR) == 3 * refused
    assert keys[:, :, 8:].isnan().all() and values[:, :, 8:].isnan().all()
    _overwrite(service, with_pack_field(good, ("meta", field), str(value)))  # the rewrite itself is sound
    assert len(service.get("consumer-a", HASHES)) == 3


@pytest.mark.parametrize("path", [("tensors", 0, "offset"), ("tensors", 0, "nbytes"), ("tensors", 0, "shape", 0)],
                         ids=lambda p: ".".join(map(str, p)))
def test_hostile_numbers_in_a_stored_tensor_pack_are_refused_chunks_not_crashes(service, path):
    good = service.binding(PRODUCER).codec.encode(correlated_state(8, start=8, seed=7))
    value = pack_header(good)
    for step in path:
        value = value[step]
    for refused, token in enumerate(hostile_variants(value), start=1):
        _overwrite(service, with_pack_field(good, path, token))
        assert len(service.get("consumer-a", HASHES)) == 1
        raw, targets = _paged()
        assert service.get_paged("consumer-a", HASHES, targets) == 1
        assert all(c[1:].isnan().all() for c in raw)
        assert service.store.stats.value("refused_chunks", pair=PAIR) == 2 * refused
