"""PATCH: H_in codes and aligners that regenerate K / V with the consumer's own projections."""

import pytest
import torch

from scd_store.adapters.transformers import prefill_capture
from scd_store.adapters.transformers.layout import layout_of
from scd_store.codecs.scd.bundle import load_pair, load_space, save_pair, save_space
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.layout import to_features
from scd_store.codecs.scd.patch import PatchAligner
from scd_store.codecs.scd.space import CodeSpace
from tests.conftest import tiny_llama

PATCHED = (1,)


def _space(model, budget: float, patched=PATCHED) -> CodeSpace:
    layout = layout_of(model)
    feats, hidden = [], {layer: [] for layer in patched}
    for seed in range(6):
        ids = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(seed))
        state, _ = prefill_capture(model, ids, hidden_layers=patched)
        feats.append(to_features(state, layout)[4:])
        for layer in patched:
            hidden[layer].append(state.hidden[layer][4:])
    x = torch.cat(feats).transpose(0, 1).double()
    mean = x.mean(1)
    cov = torch.einsum("gtc,gtd->gcd", x - mean[:, None], x - mean[:, None]) / x.shape[1]
    stats = None
    if patched:
        h = torch.stack([torch.cat(hidden[layer]) for layer in patched]).double()  # [P, N, D]
        h_mean = h.mean(1)
        h_cov = torch.einsum("pnd,pne->pde", h - h_mean[:, None], h - h_mean[:, None]) / h.shape[1]
        stats = (patched, h_mean, h_cov)
    return CodeSpace.from_statistics("patch-test", layout, mean, cov, budget, hidden_stats=stats)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_hidden_patch_regenerates_the_consumers_own_kv(monkeypatch):
    model = tiny_llama(seed=0)
    space = _space(model, budget=0.5)
    assert all(int(space.bits[2 * layer : 2 * layer + 2].sum()) == 0 for layer in PATCHED)
    attention = model.model.layers[1].self_attn
    patch = PatchAligner.initial(1, "hidden", attention, units=8, seed=0)
    decoder = PairDecoder.identity(space, "self")
    decoder.patches.append(patch)
    codec = ScdCodec(space, decoder)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(42))
    state, _ = prefill_capture(model, ids, hidden_layers=PATCHED)
    out = codec.decode(codec.encode(state))
    # layer 1's K / V are not in the payload: they come from the coded H_in through the model's own W_k / W_v
    assert _rel(out.keys[1], state.keys[1]) < 0.05 and _rel(out.values[1], state.values[1]) < 0.05
    # decoded in token chunks on a CPU, the aligners read the matching rows of H_in
    import scd_store.codecs.scd.codec as codec_module
    monkeypatch.setattr(codec_module, "_CPU_STEP_TOKENS", 7)
    chunked = codec.decode(codec.encode(state))
    torch.testing.assert_close(chunked.keys, out.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked.values, out.values, atol=1e-5, rtol=1e-5)
    without_patch_payload = ScdCodec(_space(model, budget=0.5, patched=())).encode(state)
    assert len(codec.encode(state)) > len(without_patch_payload)  # H_in (width 64) costs more than K+V (32)


def test_hidden_space_needs_hidden_states_and_matching_decoders():
    model = tiny_llama(seed=0)
    space = _space(model, budget=0.3)
    state, _ = prefill_capture(model, torch.randint(0, 128, (12,)))
    with pytest.raises(ValueError, match="capture H_in"):
        ScdCodec(space).encode(state)
    with pytest.raises(ValueError, match="patches H_in at layers"):
        ScdCodec(space, PairDecoder.identity(space, "no-patch"))


def test_kv_patch_starts_at_reuse_and_changes_only_its_layer():
    model = tiny_llama(seed=0)
    space = _space(model, budget=0.3, patched=())
    ids = torch.randint(0, 128, (30,))
    state, _ = prefill_capture(model, ids)
    payload = ScdCodec(space).encode(state)
    plain = ScdCodec(space, PairDecoder.identity(space, "c"), matmul="float32").decode(payload)  # as PATCH decodes
    decoder = PairDecoder.identity(space, "c")
    decoder.patches.append(PatchAligner.initial(2, "kv", model.model.layers[2].self_attn, units=8, seed=0))
    torch.testing.assert_close(ScdCodec(space, decoder).decode(payload).keys, plain.keys)
    with torch.no_grad():
        decoder.patches[0].w_out.normal_(std=0.1)
    patched = ScdCodec(space, decoder).decode(payload)
    assert torch.equal(patched.keys[:2], plain.keys[:2]) and not torch.allclose(patched.keys[2], plain.keys[2])


def test_patch_bundle_round_trip(tmp_path):
    model = tiny_llama(seed=0)
    space = _space(model, budget=0.3)
    decoder = PairDecoder.identity(space, "c")
    decoder.patches.append(PatchAligner.initial(1, "hidden", model.model.layers[1].self_attn, units=8, seed=0))
    decoder.patches.append(PatchAligner.initial(2, "kv", model.model.layers[2].self_attn, units=8, seed=1))
    with torch.no_grad():
        decoder.patches[0].w_out.normal_(std=0.1)
    save_space(tmp_path, space)
    save_pair(tmp_path, decoder)
    loaded_space = load_space(tmp_path)
    assert loaded_space.patch_layers == PATCHED and loaded_space.fingerprint == space.fingerprint
    loaded = load_pair(tmp_path, "c", loaded_space)
    assert [(p.layer, p.source) for p in loaded.patches] == [(1, "hidden"), (2, "kv")]
    assert loaded.fingerprint == decoder.fingerprint
    state, _ = prefill_capture(model, torch.randint(0, 128, (20,)), hidden_layers=PATCHED)
    payload = ScdCodec(space).encode(state)
    torch.testing.assert_close(ScdCodec(loaded_space, loaded).decode(payload).keys,
                               ScdCodec(space, decoder).decode(payload).keys)
