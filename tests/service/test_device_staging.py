"""The staged device decode both engine adapters share (:mod:`scd_store.service.device_staging`): a private stream
per calling thread that waits for the caller's current stream before the first decode, copies queued after each
decode, a wait that synchronises the private stream only (never the caller's, an engine's stream inside its
worker), run also when the get raises, and a device with no room for the staging ending the run. On the CPU
with injected streams that log what happens to them; where CUDA is present, on real streams."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import pytest
import torch

from scd_store.service import KVService
from scd_store.service.device_staging import PrivateStreams, StagedRun, StagingBuffer, current_stream
from scd_store.service.log_once import LogOnce
from scd_store.store.registry import FileRegistry
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from tests.bundles import LAYOUT, PRODUCER, chunked, write_tiny_bundle

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA streams need CUDA")
SHAPE = (2, 3, 4)


class FakeStream:
    """Stands in for ``torch.cuda.Stream``: logs what is asked of it."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def synchronize(self) -> None:
        self.log.append(f"sync {self.name}")


class Recorded:
    """:class:`PrivateStreams` on the CPU whose streams, stream scope, caller's stream and copies log to ``log``;
    ``current[0]`` is the stream current in the calling thread (the engine's outside a run)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.engine = FakeStream("engine", self.log)
        self.current: list[FakeStream] = [self.engine]
        self.made: list[FakeStream] = []
        self.hosts: list[torch.Tensor] = []
        self.streams = PrivateStreams(torch.device("cpu"), self.new_stream, self.use_stream, lambda device: self.engine)
        real_copy = self.streams.copy

        def copy(host: torch.Tensor, staging: torch.Tensor) -> None:
            self.log.append(f"copy {self.index(host)} on {self.current[0].name}")
            real_copy(host, staging)

        self.streams.copy = copy  # type: ignore[method-assign]

    def index(self, host: torch.Tensor) -> int:
        return next((i for i, h in enumerate(self.hosts) if h is host), -1)

    def new_stream(self, device: torch.device) -> FakeStream:
        self.made.append(FakeStream(f"private-{len(self.made)}", self.log))
        return self.made[-1]

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        before, self.current[0] = self.current[0], stream
        self.log.append(f"enter {stream.name}")
        try:
            yield
        finally:
            self.current[0] = before
            self.log.append(f"exit {stream.name}")

    def get(self, run: StagedRun, count: int, refuse: int | None = None, fail: int | None = None) -> int:
        """``KVService.get`` as its decode loop drives ``into``: item ``i``'s staging is asked for once ``i - 1``
        is decoded; a decode fills it with ``i + 1``. ``refuse``: the item whose decode is refused after it got
        its staging (half-written); ``fail``: the item whose decode raises."""
        self.hosts = [torch.zeros(SHAPE) for _ in range(count)]
        decoded = 0
        for i, host in enumerate(self.hosts):
            staging = run.stage_into(host)
            if staging is None:
                break
            if i == fail:
                raise RuntimeError("store went away")
            staging.fill_(float(i + 1))
            self.log.append(f"decode {i} on {self.current[0].name}")
            if i == refuse:
                break
            decoded += 1
        return decoded

    def run(self) -> StagedRun:
        return StagedRun(self.streams, StagingBuffer(torch.device("cpu")))


def test_a_run_waits_for_the_callers_stream_then_decodes_and_copies_on_its_own_and_syncs_only_that():
    rec = Recorded()
    with rec.run() as run:
        run.land(rec.get(run, 3))
    assert rec.log == ["private-0 waits for engine", "enter private-0",
                       "decode 0 on private-0", "copy 0 on private-0",  # each copy queued after its decode,
                       "decode 1 on private-0", "copy 1 on private-0",  # before the next decode overwrites
                       "decode 2 on private-0", "copy 2 on private-0",
                       "exit private-0", "sync private-0"]
    assert "sync engine" not in rec.log and rec.current == [rec.engine]  # the caller's stream is current again
    assert all(bool((h == i + 1).all()) for i, h in enumerate(rec.hosts))


def test_the_wait_runs_when_the_get_raises_and_a_chunk_never_decoded_is_not_copied():
    rec = Recorded()
    with pytest.raises(RuntimeError, match="store went away"), rec.run() as run:
        rec.get(run, 3, fail=1)
    assert rec.log == ["private-0 waits for engine", "enter private-0", "decode 0 on private-0",
                       "copy 0 on private-0", "exit private-0", "sync private-0"]
    assert bool((rec.hosts[0] == 1).all()) and int(rec.hosts[1].abs().sum()) == 0


def test_a_refused_item_is_not_copied_and_the_run_ends_there():
    rec = Recorded()
    with rec.run() as run:
        run.land(rec.get(run, 3, refuse=1))
    assert [e for e in rec.log if e.startswith("copy")] == ["copy 0 on private-0"]
    assert rec.log[-1] == "sync private-0" and int(rec.hosts[1].abs().sum()) == 0  # its half-written staging stays


def test_a_device_with_no_room_for_the_staging_ends_the_run_logged_once(monkeypatch, caplog):
    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("no room")

    rec = Recorded()
    buffer = StagingBuffer(torch.device("cpu"), "page")
    for _ in range(2):
        with StagedRun(rec.streams, buffer) as run:
            hosts = rec.hosts = [torch.zeros(SHAPE), torch.zeros(5)]  # the second needs a staging of its own
            run.stage_into(hosts[0]).fill_(4.0)
            with monkeypatch.context() as patch:
                patch.setattr(torch, "empty", full)
                assert run.stage_into(hosts[1]) is None  # the previous item's copy was queued first
            run.land(1)
        assert bool((hosts[0] == 4).all())
        assert rec.log[-3:] == ["copy 0 on private-0", "exit private-0", "sync private-0"]
        buffer.tensor = None  # the next run allocates (and fails) again
    run_lines = [r for r in caplog.records if "has no room" in r.getMessage()]
    assert len(run_lines) == 1 and "pages from there on miss" in run_lines[0].getMessage()


def test_the_staging_is_reused_item_after_item_and_kept_per_thread_between_runs():
    rec = Recorded()
    staged: list[int] = []
    for _ in range(2):
        with StagedRun(rec.streams, rec.streams.buffer()) as run:
            for _ in range(2):
                staged.append(run.stage_into(torch.zeros(SHAPE)).data_ptr())
            run.land(2)
    assert len(set(staged)) == 1 and rec.streams.buffer() is rec.streams.buffer()
    elsewhere: list[object] = []
    thread = threading.Thread(target=lambda: elsewhere.extend([rec.streams.buffer(), rec.streams.stream()]))
    thread.start()
    thread.join()
    assert elsewhere[0] is not rec.streams.buffer() and elsewhere[1] is not rec.streams.stream()
    assert len(rec.made) == 2  # one stream per thread, made on its first call


def test_off_cuda_there_is_no_callers_stream_to_wait_for():
    assert current_stream(torch.device("cpu")) is None
    log: list[str] = []
    streams = PrivateStreams(torch.device("cpu"), lambda device: FakeStream("private", log),
                             lambda stream: contextlib.nullcontext())
    with StagedRun(streams, StagingBuffer(torch.device("cpu"))):
        pass
    assert log == ["sync private"]


@pytest.fixture
def service(tmp_path):
    """A service whose producer stored three 8-token chunks."""
    write_tiny_bundle(tmp_path / "bundle")
    store = TieredStore([CpuTier(1 << 22)], FileRegistry(tmp_path / "reg.json"), chunk_size=8)
    service = KVService(store, [tmp_path / "bundle"])
    hashes = [bytes([i + 1]) * 16 for i in range(3)]
    assert service.put(PRODUCER, hashes, chunked(3, 8, seed=4)) == 3
    yield service, hashes
    store.close()


def staged_get(service: KVService, hashes: list[bytes], streams: PrivateStreams) -> list[torch.Tensor]:
    """A consumer's get through a staged run: chunk i's keys and values land in ``hosts[i]``."""
    hosts = [torch.zeros(2, LAYOUT.num_layers, LAYOUT.kv_heads, 8, LAYOUT.head_dim) for _ in hashes]
    if streams.device.type == "cuda":
        hosts = [h.pin_memory() for h in hosts]
    with StagedRun(streams, StagingBuffer(streams.device)) as run:

        def into(i: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
            staging = run.stage_into(hosts[i])
            return None if staging is None else (staging[0], staging[1])

        run.land(len(service.get("consumer-a", hashes, into=into)))
    return hosts


def test_through_the_services_decode_loop_the_staged_run_lands_the_services_decode(service):
    service, hashes = service
    rec = Recorded()
    hosts = staged_get(service, hashes, rec.streams)
    want = service.get("consumer-a", hashes)
    assert len(want) == 3 and rec.log[-1] == "sync private-0" and "sync engine" not in rec.log
    assert all(torch.equal(h[0], s.keys) and torch.equal(h[1], s.values) for h, s in zip(hosts, want, strict=True))


@needs_cuda
def test_on_cuda_the_run_sees_the_callers_inputs_and_leaves_its_later_work_unwaited():
    device = torch.device("cuda", torch.cuda.current_device())
    engine = torch.cuda.Stream(device)  # stands for vLLM's engine stream, current in its worker thread
    source = torch.randn(SHAPE, device=device)
    produced = torch.zeros(SHAPE, device=device)
    torch.cuda.synchronize(device)  # made on the default stream, which the engine's does not follow
    streams = PrivateStreams(device)
    hosts = [torch.zeros(SHAPE).pin_memory() for _ in range(3)]
    seen: list[torch.cuda.Stream] = []
    with torch.cuda.stream(engine):
        torch.cuda._sleep(50_000_000)  # the engine's queued work: the input is written late
        produced.copy_(source)
        with StagedRun(streams, StagingBuffer(device)) as run:
            for i, host in enumerate(hosts):
                staging = run.stage_into(host)
                seen.append(torch.cuda.current_stream(device))
                staging.copy_(produced * (i + 1))  # reads the caller's input on the private stream
                if i == len(hosts) - 1:
                    with torch.cuda.stream(engine):  # the engine queues more work after the run began
                        torch.cuda._sleep(2_000_000_000)
            run.land(len(hosts))
        assert not engine.query()  # the run returned without waiting for the engine's later work
        assert torch.cuda.current_stream(device) == engine
    for i, host in enumerate(hosts):
        assert torch.equal(host, (source * (i + 1)).cpu())  # complete, and made from the input the caller wrote
    assert set(seen) == {streams.stream()} and streams.stream() not in (engine, torch.cuda.default_stream(device))
    engine.synchronize()


@needs_cuda
def test_on_cuda_each_thread_has_its_own_stream_and_pages_go_to_pinned_host_memory(service):
    service, hashes = service
    device = torch.device("cuda", torch.cuda.current_device())
    streams = PrivateStreams(device)
    hosts = staged_get(service, hashes, streams)
    want = service.get("consumer-a", hashes, device=device)
    for h, s in zip(hosts, want, strict=True):
        torch.testing.assert_close(h[0], s.keys.cpu(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h[1], s.values.cpu(), atol=1e-5, rtol=1e-5)
    with streams.scope():
        page = streams.to_host(torch.ones(SHAPE, device=device))
    streams.wait()
    assert page.device.type == "cpu" and page.is_pinned() and bool((page == 1).all())
    other: list[torch.cuda.Stream] = []
    thread = threading.Thread(target=lambda: other.append(streams.stream()))
    thread.start()
    thread.join()
    assert other[0] != streams.stream()


def test_the_oom_line_goes_to_the_adapters_logger_when_it_gives_its_own(monkeypatch, caplog):
    mine = logging.getLogger("scd_store.tests.staging")
    buffer = StagingBuffer(torch.device("cpu"), "chunk", LogOnce(mine))

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(torch, "empty", full)
    assert buffer.get(SHAPE, torch.float32) is None
    assert [r.name for r in caplog.records if "has no room" in r.getMessage()] == ["scd_store.tests.staging"]
