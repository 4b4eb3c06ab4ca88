import pytest
import torch

from scd_store.codecs.tensor_pack import MAGIC, PayloadError, pack, unpack


def test_round_trip_preserves_every_dtype_and_shape():
    tensors = {
        "f32": torch.randn(3, 5),
        "f16": torch.randn(7).half(),
        "bf16": torch.randn(2, 2, 2).bfloat16(),
        "u8": torch.randint(0, 255, (9,), dtype=torch.uint8),
        "empty": torch.empty(0, 4),
    }
    codec, meta, out = unpack(pack("demo", {"a": 1}, tensors), "demo")
    assert codec == "demo" and meta == {"a": 1}
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor)


def test_payload_starts_with_magic_and_has_no_pickle_opcodes():
    payload = pack("demo", {}, {"x": torch.zeros(4)})
    assert payload.startswith(MAGIC)
    assert b"\x80\x04\x95" not in payload  # the pickle protocol 4 frame header


@pytest.mark.parametrize("cut", [0, 3, 10, 40])
def test_truncated_payload_is_rejected(cut):
    payload = pack("demo", {}, {"x": torch.arange(64, dtype=torch.float32)})
    with pytest.raises(PayloadError):
        unpack(payload[: len(payload) - 64 - cut] if cut else payload[:5])


def test_wrong_codec_magic_and_version_are_rejected():
    payload = bytearray(pack("demo", {}, {"x": torch.zeros(2)}))
    with pytest.raises(PayloadError, match="expected 'other'"):
        unpack(bytes(payload), "other")
    bad_magic = b"XXXX" + bytes(payload[4:])
    with pytest.raises(PayloadError, match="magic"):
        unpack(bad_magic)
    payload[4] = 99
    with pytest.raises(PayloadError, match="version"):
        unpack(bytes(payload))


def test_header_claiming_more_bytes_than_present_is_rejected():
    payload = pack("demo", {}, {"x": torch.zeros(8)})
    lying = payload.replace(b'"shape":[8]', b'"shape":[9]')
    with pytest.raises(PayloadError, match="size or bounds"):
        unpack(lying)


def test_trailing_or_missing_padding_is_rejected():
    payload = pack("demo", {}, {"x": torch.zeros(3)})
    with pytest.raises(PayloadError, match="describes"):
        unpack(payload + b"\0")
    with pytest.raises(PayloadError):
        unpack(payload[:-1])


@pytest.mark.parametrize("meta", [{"a": 1}, {"long": "x" * 6000}])  # headers within and beyond the first read
def test_tensor_payload_gives_views_equal_to_the_bytes_path(meta):
    tensors = {"f32": torch.randn(3, 5), "f16": torch.randn(7).half(), "u8": torch.arange(9, dtype=torch.uint8)}
    payload = pack("demo", meta, tensors)
    buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    codec, got_meta, out = unpack(buffer, "demo")
    assert codec == "demo" and got_meta == meta
    for name, tensor in tensors.items():
        assert torch.equal(out[name], tensor)
        assert out[name].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view, no copy
    with pytest.raises(PayloadError):
        unpack(buffer[:-8], "demo")
    with pytest.raises(PayloadError):
        unpack(buffer.view(2, -1), "demo")
