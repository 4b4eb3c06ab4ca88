"""Tensor payloads (a GPU tier's blobs) and CUDA-graph replay of REUSE decodes."""

import pytest
import torch

from scd_store.codecs import PayloadError
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder
from tests.bundles import LAYOUT, correlated_state, tiny_space

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")


def codec_pair(cuda_graphs: bool = True) -> ScdCodec:
    space = tiny_space(0.3, "test", 2, "prod-fp")
    decoder = PairDecoder.identity(space, "c", mean_shift=torch.randn(LAYOUT.groups, LAYOUT.width,
                                                                       generator=torch.Generator().manual_seed(1)))
    return ScdCodec(space, decoder, cuda_graphs=cuda_graphs)


def as_tensor(payload: bytes, device: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


def test_tensor_payload_decodes_like_bytes(device):
    codec = codec_pair()
    payload = codec.encode(correlated_state(40, start=1, seed=2))
    from_bytes = codec.decode(payload, device=device)
    from_tensor = codec.decode(as_tensor(payload, device), device=device)
    assert from_tensor.start == from_bytes.start == 1
    torch.testing.assert_close(from_tensor.keys, from_bytes.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(from_tensor.values, from_bytes.values, atol=1e-5, rtol=1e-5)


def test_bad_tensor_payloads_are_refused(device):
    codec = codec_pair()
    payload = codec.encode(correlated_state(20, start=0, seed=2))
    with pytest.raises(PayloadError):
        codec.decode(as_tensor(payload, device)[:-16], device=device)
    with pytest.raises(PayloadError):
        codec.decode(as_tensor(payload, device).view(torch.int8), device=device)
    other = tiny_space(0.2, "other", 2, "prod-fp")
    with pytest.raises(PayloadError):
        codec.decode(as_tensor(ScdCodec(other).encode(correlated_state(20, start=0, seed=2)), device), device=device)


def test_no_graphs_without_cuda_or_for_patch_free_off_switch():
    assert codec_pair(cuda_graphs=False).graphs is None
    if not torch.cuda.is_available():
        assert codec_pair().graphs is None


@needs_cuda
@pytest.mark.parametrize("on_device", [False, True])
def test_graph_replay_equals_eager_decode_at_every_start(on_device):
    graphed, eager = codec_pair(), codec_pair(cuda_graphs=False)
    results = []
    for seed, start in enumerate((0, 1, 9, 40, 9, 0)):  # 0 and 1 hold sink tokens; 9 and 40 do not
        payload = graphed.encode(correlated_state(24 - min(start, 2), start=start, seed=seed))
        for _ in range(3):  # eager, capture, replay
            got = graphed.decode(as_tensor(payload, "cuda") if on_device else payload, device="cuda")
        want = eager.decode(payload, device="cuda")
        assert got.start == start
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)
        results.append((got, want))
    assert graphed.graphs.captures >= 2 and graphed.graphs.replays >= 6
    for got, want in results:  # every result is its own copy: later replays did not overwrite it
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)


@needs_cuda
def test_graph_path_still_refuses_bad_payloads_and_respects_its_limits():
    codec = codec_pair()
    payload = codec.encode(correlated_state(30, start=0, seed=4))
    for _ in range(3):
        codec.decode(payload, device="cuda", dtype=torch.bfloat16)
    assert codec.graphs.captures == 1
    forged = bytearray(payload)
    forged[forged.index(b'"start":0') + 8] = ord("7")  # start 7 with 2 sink tokens: inconsistent
    with pytest.raises(PayloadError):
        codec.decode(bytes(forged), device="cuda", dtype=torch.bfloat16)
    codec.graphs.max_tokens = 16
    for _ in range(3):
        codec.decode(payload, device="cuda", dtype=torch.float16)
    assert codec.graphs.captures == 1  # over max_tokens: decoded eagerly
