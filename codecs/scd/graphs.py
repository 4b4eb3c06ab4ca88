"""CUDA-graph replay of SCD REUSE decodes, captured at warm-up only.

On a GPU a serving-length decode is a few dozen small kernels: launching them from Python costs
more than running them. A captured graph replays them in one launch. One graph serves every
payload of the same shape (coded tokens, sink tokens, device, output dtype); the payload's
sections and its tokens' RoPE angles are copied into the graph's static inputs, so the chunks of
a long prefix, at different start positions, share graphs.

Graphs are captured only by :meth:`DecodeGraphs.warm_up`, which the engine-facing code calls once,
at start-up or when a consumer is bound to a device, for the chunk sizes it will serve; never
lazily on a serving thread, where another thread's CUDA call would break a capture. Captures run
in CUDA's thread-local capture mode (only the capturing thread's own unsafe calls are refused). A
shape not captured decodes eagerly (counted in ``eager_decodes``, logged once).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.range_coding import PACKING as ENTROPY_PACKING
from scd_store.codecs.tensor_pack import PayloadError, unpack

if TYPE_CHECKING:
    from scd_store.codecs.scd.space import CodeSpace, SpaceCodes


class ScdCodec(Protocol):
    """What a captured decode needs of :class:`~scd_store.codecs.scd.codec.ScdCodec` (named here, so the
    codec can import this module without a cycle)."""

    space: CodeSpace

    def angles(self, start: int, tokens: int, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode_codes(self, codes: SpaceCodes, device, dtype: torch.dtype,
                     angles: tuple[torch.Tensor, torch.Tensor] | None = None,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None) -> KVState: ...


log = logging.getLogger(__name__)

GraphKey = tuple


class CudaBackend:
    """How :class:`DecodeGraphs` reaches CUDA: streams, a thread-local capture, ``record_stream``. (Tests
    inject a CPU stand-in with the same methods.)"""

    def new_stream(self, device: torch.device) -> Any:
        """A new stream on ``device``."""
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        """The calling thread's current stream on ``device``."""
        return torch.cuda.current_stream(device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """``stream`` current in the calling thread while the context is open."""
        return torch.cuda.stream(stream)

    def capture(self, run: Callable[[], KVState]) -> tuple[Callable[[], None], KVState]:
        """``run`` captured in a CUDA graph in thread-local mode (another thread's CUDA calls during the capture
        neither break it nor are refused): the graph's replay, and ``run``'s output (in the graph's pool)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = run()
        return graph.replay, out

    def record(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until the work queued on ``stream`` when it is freed has run."""
        tensor.record_stream(stream)


class _CapturedDecode:
    """One captured decode: static inputs, the graph's replay, and its output KV (in the graph's pool)."""

    def __init__(self, codec: ScdCodec, backend: CudaBackend, meta: dict, tensors: dict[str, torch.Tensor],
                 coded: int, device: torch.device, dtype: torch.dtype) -> None:
        self.inputs = {name: torch.empty(t.shape, dtype=t.dtype, device=device) for name, t in tensors.items()}
        half = codec.space.layout.head_dim // 2
        self.cos = torch.empty(coded, half, device=device)
        self.sin = torch.empty(coded, half, device=device)
        self.meta = dict(meta)
        start, _, sinks = codec.space.counts(meta)
        self.load(codec, tensors, start + sinks)

        def run() -> KVState:
            codes = codec.space.codes_from(self.meta, self.inputs, device)
            return codec.decode_codes(codes, device, dtype, (self.cos, self.sin))

        side, current = backend.new_stream(device), backend.current_stream(device)
        side.wait_stream(current)
        with backend.use_stream(side):  # warm up: fills the codec's caches (matrices, rows), checks the payload
            run()
            run()
        current.wait_stream(side)
        self.replay, self.out = backend.capture(run)

    def load(self, codec: ScdCodec, tensors: dict[str, torch.Tensor], first_coded: int) -> None:
        for name, tensor in tensors.items():
            self.inputs[name].copy_(tensor)
        cos, sin = codec.angles(first_coded, self.cos.shape[0], self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)


class DecodeGraphs:
    """The captured decodes of one :class:`ScdCodec`: at most ``max_graphs``, each of at most ``max_tokens``
    tokens (longer decodes amortise their launches, and a graph's memory pool would keep their intermediates).

    :meth:`warm_up` captures; :meth:`decode` only replays (``None``: decode eagerly). Replays are serialised
    on one private stream per device (the static inputs are shared); each returns a copy of the graph's
    output KV, and the payload's tensors are recorded on that stream (their memory outlives the replay)."""

    def __init__(self, codec: ScdCodec, max_graphs: int = 8, max_tokens: int = 4096,
                 backend: CudaBackend | None = None) -> None:
        if max_graphs < 1 or max_tokens < 1:
            raise ValueError("max_graphs and max_tokens must be positive")
        self.codec, self.max_graphs, self.max_tokens = codec, max_graphs, max_tokens
        self.backend = backend if backend is not None else CudaBackend()
        self._graphs: dict[GraphKey, _CapturedDecode] = {}
        self._failed: set[GraphKey] = set()
        self._lock = threading.Lock()
        self._streams: dict[torch.device, Any] = {}
        self._told: set[str] = set()  # what was logged once
        self.captures = 0
        self.replays = 0
        self.eager_decodes = 0  # decodes of a shape no graph was captured for

    # ----------------------------------------------------------------- warm-up: the only capture
    def warm_up(self, device: torch.device | str, dtype: torch.dtype, tokens: Iterable[int],
                starts: Iterable[int] | None = None) -> int:
        """Capture the decodes of chunks of each count in ``tokens`` on ``device`` into ``dtype``, at each of
        ``starts`` (default: 0, a prefix's first chunk, holding the sink tokens, and just past the sinks,
        every later chunk); returns how many graphs this call captured. Call once at start-up or when a
        consumer is bound to a device, before serving: never from a serving thread mid-serving. Range-coded
        spaces (decoded on the host first), counts past ``max_tokens`` and shapes past ``max_graphs`` capture
        nothing (the last two logged)."""
        device = self._resolved(torch.device(device))
        space = self.codec.space
        if space.packing == ENTROPY_PACKING:
            return 0
        starts = (0, space.sink_tokens) if starts is None else tuple(starts)
        before = self.captures
        with self._lock:
            for count in sorted(set(tokens)):
                if count < 1:
                    continue
                if count > self.max_tokens:
                    log.warning("SCD decodes of %d tokens are not captured (max_tokens %d): decoded eagerly", count,
                                self.max_tokens)
                    continue
                for start in sorted(set(starts)):
                    self._warm_one(device, dtype, count, start)
        return self.captures - before

    def _warm_one(self, device: torch.device, dtype: torch.dtype, count: int, start: int) -> None:
        """Capture the shape of a ``count``-token chunk at ``start`` unless it is captured (or failed) already."""
        layout = self.codec.space.layout
        shape = (layout.num_layers, layout.kv_heads, count, layout.head_dim)
        try:
            payload = self.codec.space.encode(KVState(torch.zeros(shape), torch.zeros(shape), start=start))
            _, meta, tensors = unpack(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device))
            _, tokens, sinks = self.codec.space.counts(meta)
        except (PayloadError, ValueError) as exc:  # e.g. past the engine's context length
            log.warning("SCD decode graph for %d tokens at %d not captured: %s", count, start, exc)
            return
        key = self._key(tokens - sinks, sinks, device, dtype, tensors)
        if tokens == sinks or key in self._graphs or key in self._failed:
            return
        if len(self._graphs) >= self.max_graphs:
            log.warning("SCD decode graph for %d tokens (%d sinks) not captured: max_graphs (%d) reached; that "
                        "shape decodes eagerly", count, sinks, self.max_graphs)
            return
        self._capture(key, meta, tensors, tokens - sinks, device, dtype)

    def _capture(self, key: GraphKey, meta: dict, tensors: dict[str, torch.Tensor], coded: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        try:
            with self.backend.use_stream(self._stream(device)):
                captured = _CapturedDecode(self.codec, self.backend, meta, tensors, coded, device, dtype)
        except Exception as exc:  # noqa: BLE001 - a capture failure must cost speed, not the decode
            log.warning("CUDA graph capture of an SCD decode failed (%s); decoding this shape eagerly", exc)
            self._failed.add(key)
            return
        self._graphs[key] = captured
        self.captures += 1

    # ----------------------------------------------------------------- serving: replay only
    def decode(self, meta: dict, tensors: dict[str, torch.Tensor], device: torch.device,
               dtype: torch.dtype) -> KVState | None:
        """The decoded KV by graph replay, or ``None`` where the caller should decode eagerly (no graph was
        captured for its shape at warm-up, or it is too long). Never captures. Raises :class:`PayloadError`
        on a bad payload."""
        device = self._resolved(device)
        start, tokens, sinks = self.codec.space.counts(meta)
        coded = tokens - sinks
        if coded <= 0 or tokens > self.max_tokens:
            return None
        key = self._key(coded, sinks, device, dtype, tensors)
        with self._lock:
            captured = self._graphs.get(key)
            if captured is None:
                self._uncaptured(coded, sinks, device, dtype)
                return None
            return self._replay(captured, tensors, start, sinks, device)

    @staticmethod
    def _key(coded: int, sinks: int, device: torch.device, dtype: torch.dtype,
             tensors: dict[str, torch.Tensor]) -> GraphKey:
        return coded, sinks, device, dtype, tuple((n, tuple(t.shape), t.dtype) for n, t in sorted(tensors.items()))

    @staticmethod
    def _resolved(device: torch.device) -> torch.device:
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def _uncaptured(self, coded: int, sinks: int, device: torch.device, dtype: torch.dtype) -> None:
        self.eager_decodes += 1
        if "uncaptured" not in self._told:
            self._told.add("uncaptured")
            log.warning("no CUDA graph was captured for SCD decodes of %d coded + %d sink tokens into %s on %s: "
                        "decoded eagerly (graphs are captured by DecodeGraphs.warm_up, at start-up, only); further "
                        "such decodes are counted (eager_decodes), not logged", coded, sinks, dtype, device)

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = self.backend.new_stream(device)
        return self._streams[device]

    def _replay(self, captured: _CapturedDecode, tensors: dict[str, torch.Tensor], start: int, sinks: int,
                device: torch.device) -> KVState:
        backend = self.backend
        stream, current = self._stream(device), backend.current_stream(device)
        stream.wait_stream(current)
        with backend.use_stream(stream):
            captured.load(self.codec, tensors, start + sinks)
            captured.replay()
            keys, values = captured.out.keys.clone(), captured.out.values.clone()
        current.wait_stream(stream)
        backend.record(keys, current)
        backend.record(values, current)
        for tensor in tensors.values():  # the payload (a GPU tier's blob) was read on the private stream
            if tensor.device == device:
                backend.record(tensor, stream)
        self.replays += 1
        return KVState(keys, values, start=start)
