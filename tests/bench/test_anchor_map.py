"""An anchor followed by a bundle's map: the anchor's bytes, the map on tokens past the sinks."""

import pytest
import torch

from scd_store.bench.anchor_map import MappedAnchor
from scd_store.bench.quality import QualityConfig
from scd_store.codecs import make_codec
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.layout import KVLayout, to_features
from scd_store.codecs.scd.patch import PatchAligner

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, rope_theta=1e4)


def _state(tokens: int = 10, start: int = 0) -> KVState:
    g = torch.Generator().manual_seed(0)
    shape = (LAYOUT.num_layers, LAYOUT.kv_heads, tokens, LAYOUT.head_dim)
    return KVState(torch.randn(shape, generator=g), torch.randn(shape, generator=g), start=start)


def _decoder(weight_scale: float = 0.0, shift: float = 0.0) -> PairDecoder:
    g, c = LAYOUT.groups, LAYOUT.width
    weight = weight_scale * torch.randn(g, c, c, generator=torch.Generator().manual_seed(1))
    return PairDecoder("tuned", "space", weight, torch.full((g, c), shift))


def test_an_identity_map_gives_the_anchor_s_own_kv_and_bytes():
    state, raw = _state(), make_codec("raw")
    mapped = MappedAnchor(raw, _decoder(), LAYOUT, sink_tokens=4)
    payload = mapped.encode(state)
    assert payload == raw.encode(state)
    out = mapped.decode(payload)
    assert torch.allclose(out.keys, raw.decode(payload).keys, atol=1e-5)
    assert torch.allclose(out.values, raw.decode(payload).values, atol=1e-5)


def test_the_map_moves_every_token_past_the_sinks_in_feature_space_and_leaves_the_sinks():
    state, raw = _state(), make_codec("raw")
    decoder = _decoder(weight_scale=0.05, shift=0.5)
    out = MappedAnchor(raw, decoder, LAYOUT, sink_tokens=4).decode(raw.encode(state))
    decoded = raw.decode(raw.encode(state))
    assert torch.equal(out.keys[:, :, :4], decoded.keys[:, :, :4])
    tail = KVState(decoded.keys[:, :, 4:], decoded.values[:, :, 4:], start=4)
    x = to_features(tail, LAYOUT)
    want = x + torch.einsum("tgc,gcd->tgd", x, decoder.weight) + decoder.bias
    got = to_features(KVState(out.keys[:, :, 4:], out.values[:, :, 4:], start=4), LAYOUT)
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(got, x, atol=1e-2)


def test_without_sinks_every_token_is_mapped():
    state, raw = _state(tokens=6), make_codec("raw")
    out = MappedAnchor(raw, _decoder(shift=1.0), LAYOUT, sink_tokens=0).decode(raw.encode(state))
    assert out.num_tokens == 6
    assert torch.allclose(out.values, raw.decode(raw.encode(state)).values + 1.0, atol=1e-4)


def test_a_patch_decoder_cannot_follow_an_anchor():
    layer = torch.nn.Module()
    layer.k_proj = torch.nn.Linear(4, LAYOUT.width, bias=False)
    layer.v_proj = torch.nn.Linear(4, LAYOUT.width, bias=False)
    decoder = _decoder()
    decoder.patches = [PatchAligner.initial(0, "kv", layer, 2, 0)]
    with pytest.raises(ValueError, match="PATCH"):
        MappedAnchor(make_codec("raw"), decoder, LAYOUT, sink_tokens=4)


def test_anchor_map_names_follow_the_anchors_only():
    config = QualityConfig("tuned", methods=("oracle", "none", "raw", "int2"), anchor_map="bundle")
    assert config.mapped_anchor_names() == ["raw+map", "int2+map"]
    with pytest.raises(ValueError, match="anchor"):
        QualityConfig("tuned", methods=("oracle", "none"), anchor_map="bundle")
