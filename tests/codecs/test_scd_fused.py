"""The fused Triton decode kernel against the PyTorch decode: on CUDA where present, and always
under Triton's interpreter on the CPU (a subprocess: the interpreter is chosen at import)."""


import pytest
import torch

from scd_store.codecs import KVState
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.layout import KVLayout
from scd_store.codecs.scd.space import CodeSpace
from tests.codecs.triton_runs import run_interpreted

LAYOUT64 = KVLayout(num_layers=2, kv_heads=2, head_dim=64, rope_theta=1e4)


def space_and_decoder(sinks: int = 2) -> tuple[CodeSpace, PairDecoder]:
    """A 64-dim-head space fitted to random correlated statistics, and a decoder with a real map."""
    g = torch.Generator().manual_seed(0)
    groups, width = LAYOUT64.groups, LAYOUT64.width
    a = torch.randn(groups, width, 24, generator=g, dtype=torch.float64)
    cov = a @ a.transpose(1, 2) + 0.01 * torch.eye(width, dtype=torch.float64)
    mean = torch.randn(groups, width, generator=g, dtype=torch.float64)
    space = CodeSpace.from_statistics("fused", LAYOUT64, mean, cov, 0.3, sink_tokens=sinks, producer_fingerprint="p")
    decoder = PairDecoder.identity(space, "c", mean_shift=torch.randn(groups, width, generator=g))
    decoder.weight.copy_(0.05 * torch.randn(decoder.weight.shape, generator=g))
    return space, decoder


def state(tokens: int, start: int, seed: int) -> KVState:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    keys = torch.randn(2, 2, tokens, 32, generator=g) @ mix
    values = torch.randn(2, 2, tokens, 32, generator=g) @ mix
    return KVState(keys, values, start=start)


def compare(device: str, graphs: bool) -> None:
    space, decoder = space_and_decoder()
    fused = ScdCodec(space, decoder, cuda_graphs=graphs, fused_kernel=True)
    plain = ScdCodec(space, decoder, cuda_graphs=False, fused_kernel=False, matmul="float32")  # the kernel: fp32
    for start, tokens in ((0, 70), (1, 130), (40, 64), (7, 5)):
        if fused.graphs is not None:  # captured at warm-up only: each shape before its first decode
            for dtype in (torch.float32, torch.bfloat16):
                fused.graphs.warm_up(device, dtype, [tokens], starts=[start])
        payload = fused.encode(state(tokens, start, seed=start))
        want = plain.decode(payload, device=device)
        for _ in range(3):
            got = fused.decode(payload, device=device)
        assert got.start == start
        torch.testing.assert_close(got.keys, want.keys, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(got.values, want.values, atol=2e-4, rtol=2e-4)
        half = fused.decode(payload, device=device, dtype=torch.bfloat16)
        scale = want.keys.abs().max()
        assert float((half.keys.float() - want.keys).abs().max() / scale) < 1e-2
        assert float((half.values.float() - want.values).abs().max() / want.values.abs().max()) < 1e-2
    assert fused.fused_kernel, "the fused kernel fell back to PyTorch (same result): it must have run here"
    if fused.graphs is not None:  # every decode replayed a graph (8: four shapes, two dtypes)
        assert fused.graphs.captures == 8 and fused.graphs.eager_decodes == 0 and fused.graphs.replays == 16


@pytest.mark.slow
def test_fused_kernel_matches_the_pytorch_decode_under_the_interpreter():
    done = run_interpreted("from tests.codecs.test_scd_fused import compare; compare('cpu', False); print('ok')")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True])
def test_fused_kernel_matches_the_pytorch_decode_on_cuda(graphs):
    pytest.importorskip("triton")
    compare("cuda", graphs)
