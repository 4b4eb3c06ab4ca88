"""Tensor payloads (a GPU tier's blobs) and CUDA-graph replay of REUSE decodes: graphs are captured at warm-up
only (never on a serving thread), in thread-local capture mode. The graph logic runs on a CPU through a stand-in
backend (:class:`FakeBackend`: streams are names, a replay re-runs the captured decode on the static inputs);
the CUDA cases run where CUDA is present."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from scd_store.codecs import PayloadError
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd import graphs as graphs_module
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.graphs import CudaBackend, DecodeGraphs
from scd_store.codecs.tensor_pack import unpack
from tests.bundles import LAYOUT, correlated_state, tiny_space

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
CPU = torch.device("cpu")


def codec_pair(cuda_graphs: bool = True) -> ScdCodec:
    space = tiny_space(0.3, "test", 2, "prod-fp")
    decoder = PairDecoder.identity(space, "c", mean_shift=torch.randn(LAYOUT.groups, LAYOUT.width,
                                                                       generator=torch.Generator().manual_seed(1)))
    return ScdCodec(space, decoder, cuda_graphs=cuda_graphs)


def as_tensor(payload: bytes, device: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited_for: list[str] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_for.append(other.name)


class FakeBackend:
    """:class:`CudaBackend` on a CPU: named streams, captures that note their thread, replays that re-run ``run``."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.serving = FakeStream("serving")
        self._current: list[FakeStream] = []
        self.made: list[FakeStream] = []
        self.captured_on: list[str] = []
        self.recorded: list[tuple[int, str]] = []  # (storage pointer, stream name)

    def new_stream(self, device: torch.device) -> FakeStream:
        self.made.append(FakeStream(f"private-{len(self.made)}"))
        return self.made[-1]

    def current_stream(self, device: torch.device) -> FakeStream:
        return self._current[-1] if self._current else self.serving

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[FakeStream]:
        self._current.append(stream)
        try:
            yield stream
        finally:
            self._current.pop()

    def capture(self, run: Callable[[], KVState]) -> tuple[Callable[[], None], KVState]:
        self.captured_on.append(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        out = run()

        def replay() -> None:
            again = run()
            out.keys.copy_(again.keys)
            out.values.copy_(again.values)

        return replay, out

    def record(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.recorded.append((tensor.untyped_storage().data_ptr(), stream.name))


def cpu_graphs(codec: ScdCodec, **kwargs: Any) -> tuple[DecodeGraphs, FakeBackend]:
    backend = FakeBackend(kwargs.pop("fail", False))
    return DecodeGraphs(codec, backend=backend, **kwargs), backend  # type: ignore[arg-type]


def parts(payload: bytes | torch.Tensor) -> tuple[dict, dict[str, torch.Tensor]]:
    _, meta, tensors = unpack(payload)
    return meta, tensors


# ----------------------------------------------------------------- payloads as tensors
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


# ----------------------------------------------------------------- capture at warm-up only (CPU stand-in)
def test_serving_decodes_never_capture_and_fall_back_to_eager_logged_once(caplog):
    codec = codec_pair(cuda_graphs=False)
    graphs, backend = cpu_graphs(codec)
    payload = codec.encode(correlated_state(24, start=30, seed=3))
    with caplog.at_level(logging.WARNING, logger=graphs_module.__name__):
        for _ in range(5):  # the old lazy path captured on a shape's second decode, on the serving thread
            assert graphs.decode(*parts(payload), CPU, torch.float32) is None
    assert backend.captured_on == [] and graphs.captures == 0 and graphs.eager_decodes == 5
    assert sum("no CUDA graph was captured" in r.getMessage() for r in caplog.records) == 1


def test_warm_up_captures_first_and_later_chunks_and_replays_equal_the_eager_decode():
    codec = codec_pair(cuda_graphs=False)
    graphs, backend = cpu_graphs(codec)
    warm = threading.Thread(target=lambda: graphs.warm_up(CPU, torch.float32, [24, 24]), name="warm-up")
    warm.start()
    warm.join()
    assert graphs.captures == 2 and backend.captured_on == ["warm-up", "warm-up"]  # start 0 (2 sinks) and past them
    results = []
    for seed, start in enumerate((0, 2, 9, 40, 9, 0)):
        payload = codec.encode(correlated_state(24, start=start, seed=seed))
        got = graphs.decode(*parts(as_tensor(payload, "cpu")), CPU, torch.float32)
        want = codec.decode(payload, device="cpu")
        assert got is not None and got.start == start
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)
        results.append((got, want))
    for got, want in results:  # every result is its own copy: later replays did not overwrite it
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
    assert graphs.replays == 6 and graphs.captures == 2 and graphs.eager_decodes == 0
    other = codec.encode(correlated_state(16, start=40, seed=1))  # a shape not warmed: eager, never captured
    assert graphs.decode(*parts(other), CPU, torch.float32) is None and len(backend.captured_on) == 2


def test_a_replay_records_the_payload_on_its_stream_and_the_outputs_on_the_callers():
    codec = codec_pair(cuda_graphs=False)
    graphs, backend = cpu_graphs(codec)
    graphs.warm_up(CPU, torch.float32, [24], starts=[5])
    payload = as_tensor(codec.encode(correlated_state(24, start=5, seed=2)), "cpu")
    got = graphs.decode(*parts(payload), CPU, torch.float32)
    private = backend.made[0].name
    assert (payload.untyped_storage().data_ptr(), private) in backend.recorded  # read on the private stream
    assert (got.keys.untyped_storage().data_ptr(), "serving") in backend.recorded
    assert backend.made[0].waited_for[-1] == "serving" and backend.serving.waited_for[-1] == private


def test_warm_up_bounds_failures_and_range_coded_spaces(caplog):
    codec = codec_pair(cuda_graphs=False)
    graphs, _ = cpu_graphs(codec, max_graphs=1, max_tokens=32)
    with caplog.at_level(logging.WARNING, logger=graphs_module.__name__):
        assert graphs.warm_up(CPU, torch.float32, [24, 40]) == 1  # 40 > max_tokens; the second shape > max_graphs
    assert "max_tokens" in caplog.text and "max_graphs" in caplog.text
    failing, backend = cpu_graphs(codec, fail=True)
    assert failing.warm_up(CPU, torch.float32, [24], starts=[9]) == 0
    assert failing.warm_up(CPU, torch.float32, [24], starts=[9]) == 0 and len(backend.captured_on) == 1  # not retried
    payload = codec.encode(correlated_state(24, start=9, seed=1))
    assert failing.decode(*parts(payload), CPU, torch.float32) is None
    entropy = codec_pair(cuda_graphs=False)
    entropy.space = entropy.space.with_tables(torch.randn(256, entropy.space.bits.numel()))
    assert cpu_graphs(entropy)[0].warm_up(CPU, torch.float32, [24]) == 0  # decoded on the host first: no graph


def test_the_cuda_backend_captures_in_thread_local_mode(monkeypatch):
    seen: dict[str, Any] = {}

    class Graph:
        def replay(self) -> None:
            seen["replayed"] = True

    @contextlib.contextmanager
    def graph(cuda_graph: Graph, **kwargs: Any) -> Iterator[None]:
        seen.update(kwargs)
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    replay, out = CudaBackend().capture(lambda: "out")  # type: ignore[arg-type, return-value]
    replay()
    assert seen == {"capture_error_mode": "thread_local", "replayed": True} and out == "out"


def test_a_device_cache_entry_is_never_built_inside_a_capture(monkeypatch):
    from scd_store.codecs.device_cache import published

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA-graph capture"):
        published(("matrix",), "cuda:0")
    assert published(("matrix",), "cpu") == ("matrix",)


# ----------------------------------------------------------------- on CUDA
@needs_cuda
@pytest.mark.parametrize("on_device", [False, True])
def test_graph_replay_equals_eager_decode_at_every_start(on_device):
    graphed, eager = codec_pair(), codec_pair(cuda_graphs=False)
    warmed = graphed.graphs.warm_up("cuda", torch.float32, [24], starts=[0])  # a first chunk: 2 sinks, 22 coded
    assert warmed + graphed.graphs.warm_up("cuda", torch.float32, [22], starts=[9]) == 2  # later chunks: 22 coded
    results = []
    for seed, start in enumerate((0, 1, 9, 40, 9, 0)):  # 0 and 1 hold sink tokens; 9 and 40 do not
        payload = graphed.encode(correlated_state(24 - min(start, 2), start=start, seed=seed))
        for _ in range(3):
            got = graphed.decode(as_tensor(payload, "cuda") if on_device else payload, device="cuda")
        want = eager.decode(payload, device="cuda")
        assert got.start == start
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)
        results.append((got, want))
    assert graphed.graphs.captures == 2 and graphed.graphs.replays == 15  # start 1 (1 sink): not warmed, eager
    assert graphed.graphs.eager_decodes == 3
    for got, want in results:  # every result is its own copy: later replays did not overwrite it
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)


@needs_cuda
def test_graph_path_still_refuses_bad_payloads_and_respects_its_limits():
    codec = codec_pair()
    payload = codec.encode(correlated_state(30, start=0, seed=4))
    for _ in range(3):
        codec.decode(payload, device="cuda", dtype=torch.bfloat16)
    assert codec.graphs.captures == 0 and codec.graphs.eager_decodes == 3  # serving never captures
    codec.graphs.warm_up("cuda", torch.bfloat16, [30], starts=[0])
    codec.decode(payload, device="cuda", dtype=torch.bfloat16)
    assert codec.graphs.captures == 1 and codec.graphs.replays == 1
    forged = bytearray(payload)
    forged[forged.index(b'"start":0') + 8] = ord("7")  # start 7 with 2 sink tokens: inconsistent
    with pytest.raises(PayloadError):
        codec.decode(bytes(forged), device="cuda", dtype=torch.bfloat16)
    codec.graphs.max_tokens = 16
    assert codec.graphs.warm_up("cuda", torch.float16, [30]) == 0  # over max_tokens: decoded eagerly
    codec.decode(payload, device="cuda", dtype=torch.float16)
    assert codec.graphs.captures == 1


@needs_cuda
def test_graph_capture_at_warm_up_survives_another_threads_cuda_work():
    """Thread-local capture mode: a serving thread's allocations and stream synchronisations while another
    thread captures neither fail nor break the capture (global mode refuses them)."""
    codec, eager = codec_pair(), codec_pair(cuda_graphs=False)
    stop, errors = threading.Event(), []

    def serve() -> None:
        stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    x = torch.ones(512, 512, device="cuda")
                    (x @ x).sum()
                    stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    worker = threading.Thread(target=serve)
    worker.start()
    try:
        captured = codec.graphs.warm_up("cuda", torch.float32, [8, 16, 24, 32])
    finally:
        stop.set()
        worker.join()
    assert not errors and captured == 8 and codec.graphs.captures == 8
    payload = codec.encode(correlated_state(16, start=40, seed=2))
    got, want = codec.decode(payload, device="cuda"), eager.decode(payload, device="cuda")
    torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
    assert codec.graphs.replays == 1
