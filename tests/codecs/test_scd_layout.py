import torch

from scd_store.codecs import KVState
from scd_store.codecs.scd.layout import KVLayout, from_features, to_features


def test_features_round_trip_at_an_offset():
    layout = KVLayout(num_layers=3, kv_heads=2, head_dim=8, rope_theta=1e4)
    state = KVState(torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8), start=7)
    features = to_features(state, layout)
    assert features.shape == (5, 6, 16)
    # values of layer 1 are group 3, heads concatenated
    assert torch.equal(features[:, 3, 8:], state.values[1, 1])
    back = from_features(features, layout, start=7)
    torch.testing.assert_close(back.keys, state.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(back.values, state.values)
    assert back.start == 7


def test_token_major_writer_matches_from_features(device):
    from scd_store.codecs.scd.layout import write_token_major
    from scd_store.codecs.scd.rope import RopeTable

    layout = KVLayout(num_layers=3, kv_heads=2, head_dim=8, rope_theta=1e4)
    features = torch.randn(5, 6, 16, device=device)
    expected = from_features(features, layout, start=1030)  # beyond the table's first size: it grows
    keys = torch.full((3, 2, 7, 8), float("nan"), device=device)
    values = torch.full_like(keys, float("nan"))
    cos, sin = RopeTable(8, 1e4).halves(1030, 5, device, torch.float32)
    write_token_major(features.transpose(0, 1).contiguous(), layout, cos, sin, keys[:, :, 2:], values[:, :, 2:])
    torch.testing.assert_close(keys[:, :, 2:], expected.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values[:, :, 2:], expected.values)
    assert torch.isnan(keys[:, :, :2]).all()  # nothing written outside the slice
