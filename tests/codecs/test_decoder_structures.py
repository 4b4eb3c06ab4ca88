"""Per-head decoders: the same decode as the block-diagonal dense map, a fraction of its bytes."""

import pytest
import torch

from scd_store.bench.decoder_sizes import decoder_sizes
from scd_store.codecs.scd.bundle import load_pair, save_pair, save_space
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder, apply_map, choose_structure, decoder_bytes
from tests.bundles import LAYOUT, correlated_state, tiny_space


def per_head_decoder(space, seed=0):
    g, h, d = space.layout.groups, space.layout.kv_heads, space.layout.head_dim
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(g, h, d, d, generator=gen) * 0.1
    bias = torch.randn(g, h * d, generator=gen) * 0.1
    return PairDecoder("per-head-consumer", space.fingerprint, weight, bias, "fp")


@pytest.mark.parametrize("matmul", ["float32", "bfloat16"])
def test_a_per_head_decoder_decodes_as_its_block_diagonal_dense_map(matmul):
    space = tiny_space()
    heads = per_head_decoder(space)
    block_diagonal = torch.stack([torch.block_diag(*group.unbind(0)) for group in heads.weight])
    dense = PairDecoder("dense-consumer", space.fingerprint, block_diagonal, heads.bias, "fp")
    assert heads.structure == "per-head" and dense.structure == "dense"
    assert heads.weight.numel() * LAYOUT.kv_heads == dense.weight.numel()  # 1/H of the dense map
    state = correlated_state(20, start=3)
    payload = ScdCodec(space).encode(state)
    a = ScdCodec(space, heads, matmul=matmul).decode(payload)
    b = ScdCodec(space, dense, matmul=matmul).decode(payload)
    tol = 1e-5 if matmul == "float32" else 8e-2  # bf16: x_hat is rounded once more before the per-head map
    torch.testing.assert_close(a.keys, b.keys, atol=tol, rtol=tol)
    torch.testing.assert_close(a.values, b.values, atol=tol, rtol=tol)
    x = torch.randn(2, 5, LAYOUT.groups, LAYOUT.width)
    torch.testing.assert_close(apply_map(x, heads.weight), apply_map(x, dense.weight), atol=1e-5, rtol=1e-5)


def test_per_head_decoders_round_trip_through_a_bundle(tmp_path):
    space = tiny_space()
    decoder = per_head_decoder(space)
    save_space(tmp_path, space, extra={"producer": "p"})
    save_pair(tmp_path, decoder)
    loaded = load_pair(tmp_path, decoder.consumer, space)
    assert loaded.structure == "per-head" and loaded.fingerprint == decoder.fingerprint
    with pytest.raises(ValueError, match="per-head"):
        PairDecoder("x", space.fingerprint, torch.zeros(LAYOUT.groups, 3, 5, 5), decoder.bias)


def test_decoders_stay_within_two_percent_of_their_consumers_weights():
    rows = {r["name"]: r for r in decoder_sizes()}
    assert all(r["auto_share"] <= 0.02 for r in rows.values())
    assert rows["Llama-3-8B"]["auto"] == rows["SmolLM2-135M"]["auto"] == "dense"  # where KV heads are few
    assert rows["Llama-2-7B (MHA)"]["auto"] == "per-head" and rows["Llama-2-7B (MHA)"]["dense_bytes"] > 2e9
    assert choose_structure(60, 3, 64, 10**12) == "dense" and choose_structure(60, 3, 64, 1, "dense") == "dense"
    assert decoder_bytes(2, 2, 4, "per-head") == 2 * (2 * 2 * 16 + 4 * 8)  # bf16 map, fp32 bias
    with pytest.raises(ValueError, match="structure"):
        choose_structure(60, 3, 64, 1, "sparse")
