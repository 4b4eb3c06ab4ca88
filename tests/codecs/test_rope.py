import torch

from scd_store.adapters.transformers import prefill_capture
from scd_store.codecs.scd.rope import apply_rope, invert_rope, rope_cos_sin


def test_inverse_is_exact():
    keys = torch.randn(2, 3, 10, 16, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(10), 16, 1e5, dtype=torch.float64)
    assert torch.allclose(invert_rope(apply_rope(keys, cos, sin), cos, sin), keys, atol=1e-12)


def test_matches_the_models_own_rotation(tiny_model, device):
    # Pre-RoPE keys recomputed from H_in with the model's k_proj, rotated by our RoPE, equal the cached keys.
    ids = torch.randint(0, 128, (12,), device=device)
    state, _ = prefill_capture(tiny_model, ids, hidden_layers=[1])
    attn = tiny_model.model.layers[1].self_attn
    pre = attn.k_proj(state.hidden[1]).view(12, 2, 16).transpose(0, 1)
    cos, sin = rope_cos_sin(torch.arange(12, device=device), 16, tiny_model.config.rope_parameters["rope_theta"])
    torch.testing.assert_close(apply_rope(pre, cos, sin), state.keys[1], atol=1e-5, rtol=1e-5)


def test_table_slices_equal_direct_angles():
    from scd_store.codecs.scd.rope import RopeTable

    table = RopeTable(16, 1e5)
    for start, length in ((0, 10), (500, 700), (3000, 5)):
        cos, sin = table.get(start, length, "cpu", torch.float32)
        ref_cos, ref_sin = rope_cos_sin(torch.arange(start, start + length), 16, 1e5)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
