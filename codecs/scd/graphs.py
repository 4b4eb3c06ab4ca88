"""CUDA-graph replay of SCD REUSE decodes.

On a GPU a serving-length decode is a few dozen small kernels: launching them from Python costs
more than running them. A captured graph replays them in one launch. One graph serves every
payload of the same shape (coded tokens, sink tokens, device, output dtype); the payload's
sections and its tokens' RoPE angles are copied into the graph's static inputs, so the chunks of
a long prefix, at different start positions, share graphs.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

import torch

from scd_store.codecs.kv_state import KVState
from scd_store.codecs.tensor_pack import PayloadError

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


class _CapturedDecode:
    """One captured decode: static inputs, the graph, and its output KV (in the graph's pool)."""

    def __init__(self, codec: ScdCodec, meta: dict, tensors: dict[str, torch.Tensor], coded: int,
                 device: torch.device, dtype: torch.dtype) -> None:
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

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm up: fills the codec's caches (matrices, rows), checks the payload
            run()
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = run()

    def load(self, codec: ScdCodec, tensors: dict[str, torch.Tensor], first_coded: int) -> None:
        for name, tensor in tensors.items():
            self.inputs[name].copy_(tensor)
        cos, sin = codec.angles(first_coded, self.cos.shape[0], self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)


class DecodeGraphs:
    """The captured decodes of one :class:`ScdCodec`, least recently used dropped past ``max_graphs``.

    A shape is captured on its second decode (a one-off length costs an eager decode, not a
    capture). Decodes of more than ``max_tokens`` tokens run eagerly: their launches are amortised,
    and a graph's memory pool would keep their intermediates. Replays are serialised on one stream
    (the static inputs are shared); each returns a copy of the graph's output KV.
    """

    def __init__(self, codec: ScdCodec, max_graphs: int = 8, max_tokens: int = 4096) -> None:
        if max_graphs < 1 or max_tokens < 1:
            raise ValueError("max_graphs and max_tokens must be positive")
        self.codec, self.max_graphs, self.max_tokens = codec, max_graphs, max_tokens
        self._graphs: OrderedDict[GraphKey, _CapturedDecode] = OrderedDict()
        self._seen: OrderedDict[GraphKey, int] = OrderedDict()
        self._failed: set[GraphKey] = set()
        self._lock = threading.Lock()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.captures = 0
        self.replays = 0

    def decode(self, meta: dict, tensors: dict[str, torch.Tensor], device: torch.device,
               dtype: torch.dtype) -> KVState | None:
        """The decoded KV by graph replay, or ``None`` where the caller should decode eagerly
        (not captured yet, too long, or capture failed). Raises :class:`PayloadError` on a bad payload."""
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        start, tokens, sinks = self.codec.space.counts(meta)
        coded = tokens - sinks
        if coded <= 0 or tokens > self.max_tokens:
            return None
        key = (coded, sinks, device, dtype, tuple((n, tuple(t.shape), t.dtype) for n, t in sorted(tensors.items())))
        with self._lock:
            captured = self._graphs.get(key)
            if captured is None:
                captured = self._capture(key, meta, tensors, coded, device, dtype)
                if captured is None:
                    return None
            self._graphs.move_to_end(key)
            return self._replay(captured, tensors, start, sinks, device)

    def _capture(self, key: GraphKey, meta: dict, tensors: dict[str, torch.Tensor], coded: int,
                 device: torch.device, dtype: torch.dtype) -> _CapturedDecode | None:
        if key in self._failed:
            return None
        self._seen[key] = self._seen.pop(key, 0) + 1
        while len(self._seen) > 8 * self.max_graphs:
            self._seen.popitem(last=False)
        if self._seen[key] < 2:
            return None
        try:
            with torch.cuda.stream(self._stream(device)):
                captured = _CapturedDecode(self.codec, meta, tensors, coded, device, dtype)
        except PayloadError:
            raise
        except Exception as exc:  # noqa: BLE001 - a capture failure must cost speed, not the decode
            log.warning("CUDA graph capture of an SCD decode failed (%s); decoding this shape eagerly", exc)
            self._failed.add(key)
            return None
        self._graphs[key] = captured
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return captured

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _replay(self, captured: _CapturedDecode, tensors: dict[str, torch.Tensor], start: int, sinks: int,
                device: torch.device) -> KVState:
        stream, current = self._stream(device), torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            captured.load(self.codec, tensors, start + sinks)
            captured.graph.replay()
            keys, values = captured.out.keys.clone(), captured.out.values.clone()
        current.wait_stream(stream)
        keys.record_stream(current)
        values.record_stream(current)
        for tensor in tensors.values():
            if tensor.device == device:
                tensor.record_stream(stream)
        self.replays += 1
        return KVState(keys, values, start=start)
