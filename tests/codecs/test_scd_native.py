"""The native CPU write of the decode (``codecs/scd/native.py`` + ``kv_write.c``) against the PyTorch path."""

import logging

import pytest
import torch

from scd_store.codecs.scd import native
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.layout import KVLayout, write_token_major
from scd_store.codecs.scd.rope import RopeTable
from tests.bundles import LAYOUT, correlated_state, tiny_space

needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler: the PyTorch path is the only one")


def torch_write(features, layout, start, rope, keys, values, offset=None, monkeypatch=None):
    monkeypatch.setenv("SCD_STORE_NATIVE", "0")
    write_token_major(features.clone(), layout, start, rope, keys, values, offset)
    monkeypatch.delenv("SCD_STORE_NATIVE")


@needs_native
@pytest.mark.parametrize("tokens", [1, 5, 64, 70, 131])  # around the kernel's 64-token blocks
@pytest.mark.parametrize("with_offset", [False, True])
def test_native_write_equals_the_pytorch_ops(tokens, with_offset, monkeypatch):
    layout = KVLayout(num_layers=2, kv_heads=3, head_dim=8, rope_theta=1e4)
    generator = torch.Generator().manual_seed(tokens)
    features = torch.randn(4, tokens, 24, generator=generator)
    offset = torch.randn(4, 1, 24, generator=generator) if with_offset else None
    rope = RopeTable(8, 1e4)
    expected_k = torch.full((2, 3, tokens + 3, 8), float("nan"))
    expected_v = torch.full_like(expected_k, float("nan"))
    torch_write(features, layout, 40, rope, expected_k[:, :, 3:], expected_v[:, :, 3:], offset, monkeypatch)
    keys, values = torch.full_like(expected_k, float("nan")), torch.full_like(expected_k, float("nan"))
    assert native.write_kv(features, *rope.halves(40, tokens, "cpu", torch.float32), keys[:, :, 3:],
                           values[:, :, 3:], offset)
    torch.testing.assert_close(keys[:, :, 3:], expected_k[:, :, 3:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(values[:, :, 3:], expected_v[:, :, 3:], atol=1e-6, rtol=1e-6)
    assert torch.isnan(keys[:, :, :3]).all() and torch.isnan(values[:, :, :3]).all()  # nothing outside the slice


@needs_native
def test_layouts_the_kernel_does_not_expect_fall_back_and_write_nothing():
    rope = RopeTable(8, 1e4)
    cos, sin = rope.halves(0, 5, "cpu", torch.float32)
    features = torch.randn(4, 5, 24)
    keys, values = torch.zeros(2, 3, 5, 8), torch.zeros(2, 3, 5, 8)
    refused = [
        (features.double(), cos, sin, keys, values, None),  # not float32
        (torch.randn(4, 24, 5).transpose(1, 2), cos, sin, keys, values, None),  # features not contiguous
        (features, cos, sin, keys.transpose(2, 3), values.transpose(2, 3), None),  # tokens not D floats apart
        (features, cos, sin, keys, torch.zeros(2, 3, 6, 8)[:, :, 1:], None),  # keys and values strides differ
        (features, cos, sin, keys, values, torch.zeros(4, 24)),  # offset of the wrong shape
        (features[:2], cos, sin, keys, values, None),  # features of another layer count
    ]
    for args in refused:
        assert not native.write_kv(*args)
    assert not keys.any() and not values.any()


def test_decode_is_the_same_with_and_without_the_native_write(monkeypatch):
    space = tiny_space(0.3, "test", 2, "prod-fp")
    weight = torch.randn(LAYOUT.groups, LAYOUT.width, LAYOUT.width) * 0.05
    codec = ScdCodec(space, PairDecoder("c", space.fingerprint, weight, torch.randn(LAYOUT.groups, LAYOUT.width)))
    payload = codec.encode(correlated_state(33, seed=4))
    default = codec.decode(payload)
    monkeypatch.setenv("SCD_STORE_NATIVE", "0")
    assert not native.available()
    pytorch = codec.decode(payload)
    torch.testing.assert_close(default.keys, pytorch.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(default.values, pytorch.values, atol=1e-5, rtol=1e-5)


def test_a_failed_build_falls_back_to_pytorch_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SCD_STORE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    native._kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="scd_store.codecs"):
            assert not native.available()
        assert "native SCD kernel unavailable" in caplog.text
        assert not list((tmp_path / "native").glob("*.so"))  # no half-built library left behind
        keys = torch.zeros(2, 3, 5, 8)
        assert not native.write_kv(torch.randn(4, 5, 24), *RopeTable(8, 1e4).halves(0, 5, "cpu", torch.float32),
                                   keys, torch.zeros_like(keys))
    finally:
        native._kernel.cache_clear()


@needs_native
def test_native_gather_equals_index_select_and_refuses_bad_rows():
    codes = torch.randint(0, 256, (9, 50), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    rows = torch.tensor([8, 0, 3, 3, 8])
    out = torch.full((5, 20), float("nan"))
    assert native.gather_codes(codes, rows, 17, 20, out)
    assert torch.equal(out, codes[:, 17:37].index_select(0, rows).float())
    untouched = torch.zeros(5, 20)
    for bad_rows, first, tokens in [(torch.tensor([0, 9, 1, 2, 3]), 0, 20),  # row past the end
                                    (torch.tensor([0, -1, 1, 2, 3]), 0, 20),  # negative row
                                    (rows, 31, 20),  # tokens past the end
                                    (rows.int(), 0, 20)]:  # not int64
        assert not native.gather_codes(codes, bad_rows, first, tokens, untouched)
    assert not native.gather_codes(codes, rows, 0, 10, untouched)  # out of another shape
    assert not untouched.any()
