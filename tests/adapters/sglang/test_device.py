"""``decode_device`` for the SGLang backend: the CPU decode, the per-thread CUDA stream logic (on the CPU with an
injected stream that records what happens to it, and a stand-in for ``KVService.get`` that drives ``into`` as
the service's decode loop does), the start-time refusals, and, where CUDA is present, the real stream path."""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable

import pytest
import torch

from scd_store.adapters.sglang.device import DeviceDecode, StreamDecode, device_decode
from scd_store.adapters.sglang.pages import flat_page
from scd_store.codecs.kv_state import KVState
from scd_store.service import SettingsError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA stream path needs CUDA")


class RecordingStream:
    """Stands in for ``torch.cuda.Stream``: records its synchronisations in a shared log."""

    def __init__(self, log: list[str], device: torch.device) -> None:
        self.log, self.device = log, device

    def synchronize(self) -> None:
        self.log.append("sync")


def recording_decode(log: list[str]) -> tuple[StreamDecode, list[RecordingStream]]:
    """A :class:`StreamDecode` on the CPU whose streams and stream contexts are recorded in ``log``."""
    made: list[RecordingStream] = []
    current: list[RecordingStream | None] = [None]

    def new_stream(device: torch.device) -> RecordingStream:
        made.append(RecordingStream(log, device))
        return made[-1]

    @contextlib.contextmanager
    def use_stream(stream: RecordingStream):
        log.append("enter")
        current[0] = stream
        try:
            yield
        finally:
            current[0] = None
            log.append("exit")

    decode = StreamDecode(torch.device("cpu"), new_stream, use_stream)
    decode.current = current  # type: ignore[attr-defined]  # the stream a make() call runs on
    return decode, made


class FakeService:
    """``KVService.get`` as the decode loop drives ``into``: chunk ``i``'s buffers are asked for once chunk
    ``i - 1`` is decoded; a decode here fills them with ``i`` (keys) and ``-i`` (values). ``tokens`` per chunk;
    ``refuse``: the chunk whose decode fails after it was given buffers (it half-writes them)."""

    def __init__(self, tokens: list[int], refuse: int | None = None, fill: Callable | None = None) -> None:
        self.tokens, self.refuse, self.fill, self.calls = tokens, refuse, fill, []

    def get(self, model: str, hashes: list[bytes], **kwargs) -> list[KVState]:
        self.calls.append((model, list(hashes), sorted(kwargs)))
        into, states = kwargs.get("into"), []
        for i, tokens in enumerate(self.tokens):
            if into is None:
                keys = torch.full((POOL.layer_num, POOL.head_num, tokens, POOL.head_dim), float(i))
                states.append(KVState(keys, -keys))
                continue
            buffers = into(i, tokens)
            if buffers is None:
                break
            keys, values = buffers
            if i == self.refuse:
                keys[0].fill_(float("nan"))
                break
            if self.fill is not None:
                self.fill(keys, values, i)
            else:
                keys.fill_(float(i))
                values.fill_(-float(i))
            states.append(KVState(keys, values))
        return states


POOL = types.SimpleNamespace(layout="page_first", dtype=torch.float16, layer_num=2, head_num=2, page_size=4,
                             head_dim=3)


def page_of(i: int, pool=POOL) -> torch.Tensor:
    keys = torch.full((pool.layer_num, pool.head_num, pool.page_size, pool.head_dim), float(i))
    return flat_page(KVState(keys, -keys), pool.layout, pool.dtype)


def test_the_cpu_decode_is_the_services_get_as_before_in_the_calling_thread():
    service = FakeService([4, 4])
    pages = DeviceDecode().read(service, "m", [b"a", b"b"], POOL)
    assert service.calls == [("m", [b"a", b"b"], [])]  # no device, no buffers: the service's own decode
    assert len(pages) == 2 and all(torch.equal(p, page_of(i)) for i, p in enumerate(pages))


def test_each_thread_gets_its_own_stream_made_on_its_first_call():
    log: list[str] = []
    decode, made = recording_decode(log)
    assert made == []  # nothing made at start
    first = decode.stream()
    assert decode.stream() is first and made == [first]
    others: list[RecordingStream] = []
    threads = [threading.Thread(target=lambda: others.append(decode.stream())) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(s) for s in (first, *others)}) == 3 and len(made) == 3


def test_a_read_decodes_page_by_page_on_its_threads_stream_and_waits_for_it_before_handing_pages_back():
    log: list[str] = []
    decode, _ = recording_decode(log)
    on: list[object] = []
    service = FakeService([4, 4, 4])
    real_get = service.get
    service.get = lambda *a, **k: on.append(decode.current[0]) or log.append("get") or real_get(*a, **k)
    pages = decode.read(service, "m", [b"a", b"b", b"c"], POOL)
    log.append("returned")
    assert on == [decode.stream()]  # the decode ran with this thread's stream current
    assert log == ["enter", "get", "exit", "sync", "returned"]
    assert service.calls[0][2] == ["into"]
    # one staging page reused: each page was taken out before the next decode overwrote it
    assert len(pages) == 3 and all(torch.equal(p, page_of(i)) for i, p in enumerate(pages))


def test_a_run_ends_at_a_page_of_another_size_or_a_refused_decode_without_its_half_written_page():
    decode, _ = recording_decode([])
    short = decode.read(FakeService([4, 4, 2, 4]), "m", [b"a"] * 4, POOL)
    assert len(short) == 2 and all(torch.equal(p, page_of(i)) for i, p in enumerate(short))
    refused = decode.read(FakeService([4, 4, 4], refuse=2), "m", [b"a"] * 3, POOL)
    assert len(refused) == 2 and all(torch.equal(p, page_of(i)) for i, p in enumerate(refused))
    assert decode.read(FakeService([4], refuse=0), "m", [b"a"], POOL) == []


def test_decode_device_is_picked_at_start_and_cuda_without_cuda_is_refused(monkeypatch):
    assert type(device_decode("cpu")) is DeviceDecode
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for setting in ("cuda", "cuda:0"):
        with pytest.raises(SettingsError, match=f"decode_device is '{setting}' but CUDA is not available"):
            device_decode(setting)
    with pytest.raises(SettingsError, match="decode_device must be cpu, cuda or cuda:N"):
        device_decode("meta")


def test_bare_cuda_is_the_start_threads_device_and_a_missing_index_is_refused(monkeypatch):
    """SGLang's prefetch threads never call set_device, so ``cuda`` is resolved where the backend starts
    (the scheduler thread, already on the engine's GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    picked = device_decode("cuda")
    assert isinstance(picked, StreamDecode) and picked.device == torch.device("cuda", 1)
    assert device_decode("cuda:0").device == torch.device("cuda", 0)
    with pytest.raises(SettingsError, match="decode_device is 'cuda:2' but this process sees 2 CUDA device"):
        device_decode("cuda:2")


@needs_cuda
def test_real_streams_are_per_thread_and_their_pages_complete_in_host_memory():
    decode = device_decode("cuda")
    assert isinstance(decode, StreamDecode)
    pool = types.SimpleNamespace(layout="layer_first", dtype=torch.float32, layer_num=32, head_num=8, page_size=64,
                                 head_dim=128)
    sources = [torch.randn(pool.layer_num, pool.head_num, pool.page_size, pool.head_dim) for _ in range(4)]
    streams: list[torch.cuda.Stream] = []

    def steps(x: torch.Tensor) -> torch.Tensor:
        for _ in range(20):  # elementwise and exact on both devices; long enough for a missing wait to show
            x = x * 0.5 + 0.25
        return x

    def fill(keys: torch.Tensor, values: torch.Tensor, i: int) -> None:
        streams.append(torch.cuda.current_stream(keys.device))
        keys.copy_(steps(sources[i].to(keys.device)))
        values.copy_(-keys)

    pages = decode.read(FakeService([pool.page_size] * 4, fill=fill), "m", [b"a"] * 4, pool)
    assert set(streams) == {decode.stream()} and streams[0] != torch.cuda.default_stream(decode.device)
    for i, page in enumerate(pages):
        want = steps(sources[i])
        assert page.device.type == "cpu" and torch.equal(page, flat_page(KVState(want, -want), pool.layout,
                                                                          pool.dtype))
    other: list[torch.cuda.Stream] = []
    thread = threading.Thread(target=lambda: other.append(decode.stream()))
    thread.start()
    thread.join()
    assert other[0] != decode.stream()
