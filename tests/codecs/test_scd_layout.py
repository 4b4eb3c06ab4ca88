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
