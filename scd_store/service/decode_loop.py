"""A consumer get's decode loop: :class:`DecodeLoop` turns the store's chunks into KV, chunk by chunk.

Chunks decode in order into fresh tensors, through the caller's ``into(i, tokens)`` straight into
an engine's buffers (:meth:`DecodeLoop.run`), or through a slot table straight into an engine's paged
cache (:meth:`DecodeLoop.run_paged`). The run ends at the first chunk the codec refuses (``refused_chunks``: a miss
from there on, never garbage), at the first chunk ``into`` has no room for, or once the get's
deadline has passed (``deadline_chunks``: the chunks decoded so far are the hit).

A chunk a GPU tier served carries its payload as a uint8 tensor on that tier's device
(:attr:`~scd_store.store.views.CodeChunk.on_device`): the codec takes it as it is when the decode runs on that
device (no host copy), and one copy of it on the decode's device otherwise (:func:`payload_on`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from scd_store.codecs.head_share import HeadShare
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.paged import PagedCaches
from scd_store.codecs.tensor_pack import PayloadError
from scd_store.service.bindings import Binding
from scd_store.store.log_once import Incidents
from scd_store.store.results import Payload
from scd_store.store.stats import StoreStats
from scd_store.store.views import CodeChunk

# an engine's (keys, values) buffers for chunk i of n tokens, or None: see KVService.get; into(i) is called only
# once chunk i - 1 has been decoded into its buffers (a caller may reuse one buffer for every chunk)
Buffers = Callable[[int, int], tuple[torch.Tensor, torch.Tensor] | None]

log = logging.getLogger("scd_store.service")


@dataclass(frozen=True, slots=True)
class PagedTargets:
    """Where a get writes straight into an engine's paged cache: every layer's ``caches`` and ``slots(i, tokens)``,
    chunk ``i``'s ``[tokens]`` int64 slot table on the caches' device (below 0: a token not written), or None to
    end the run there (asked for chunk ``i`` only once chunk ``i - 1`` is written)."""

    caches: PagedCaches
    slots: Callable[[int, int], torch.Tensor | None]


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (a bare ``cuda`` is the calling thread's current one)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def payload_on(chunk: CodeChunk, device: torch.device) -> Payload:
    """What the codec decodes ``chunk`` from on ``device``: its bytes, its tensor when the tensor is on ``device``,
    else one copy of the tensor there (e.g. a CPU decode of a GPU tier's hit)."""
    payload = chunk.payload
    if isinstance(payload, torch.Tensor) and not same_device(payload.device, device):
        return payload.to(device)
    return payload


class DecodeLoop:
    """Decodes a consumer's chunks with its binding's codec, counting refusals and deadlines in ``stats``."""

    def __init__(self, stats: StoreStats, incidents: Incidents, deadline_s: float | None) -> None:
        self.stats = stats
        self.incidents = incidents
        self.deadline_s = deadline_s

    def deadline(self, started: float) -> float:
        """The ``time.perf_counter()`` past which a get that started at ``started`` decodes no further chunk."""
        return started + self.deadline_s if self.deadline_s is not None else float("inf")

    def run(self, binding: Binding, chunks: Sequence[CodeChunk], *, deadline: float, device: torch.device,
            dtype: torch.dtype, into: Buffers | None, heads: HeadShare | None = None) -> list[KVState]:
        """The states of the leading run of ``chunks`` that decode before ``deadline`` (into buffers holding the
        share ``heads`` of the KV heads, when given)."""
        started = time.perf_counter()
        states: list[KVState] = []
        for i, chunk in self._each(binding, chunks, deadline):
            buffers = into(i, chunk.token_count) if into is not None else None
            if into is not None and buffers is None:
                break
            state = self._decode(binding, chunk, buffers, device, dtype, heads)
            if state is None:
                break
            states.append(state)
        self._observe(binding, chunks, started)
        return states

    def run_paged(self, binding: Binding, chunks: Sequence[CodeChunk], *, deadline: float,
                  into: PagedTargets, heads: HeadShare | None = None) -> int:
        """How many of the leading ``chunks`` were written into ``into``'s paged cache before ``deadline``."""
        started = time.perf_counter()
        written = 0
        for i, chunk in self._each(binding, chunks, deadline):
            slots = into.slots(i, chunk.token_count)
            if slots is None:
                break
            try:
                tokens = binding.codec.decode_paged(payload_on(chunk, into.caches.device), into.caches, slots,
                                                    expect_tokens=chunk.token_count, heads=heads)
                if tokens != chunk.token_count:  # a second line of defence
                    raise PayloadError(f"it decodes to {tokens} tokens; its header says {chunk.token_count}")
            except PayloadError as exc:
                self._refused(binding, chunk, exc)
                break
            written += 1
        self._observe(binding, chunks, started)
        return written

    def _each(self, binding: Binding, chunks: Sequence[CodeChunk], deadline: float) -> Iterator[tuple[int, CodeChunk]]:
        """``(i, chunk)`` in order while ``deadline`` has not passed (then counted and logged once)."""
        for i, chunk in enumerate(chunks):
            if time.perf_counter() > deadline:
                self.incidents.count("deadline_chunks", "scd-store: a get passed its %.2f s deadline; the chunks "
                                     "decoded so far are the hit (counted as deadline_chunks; logged once)",
                                     self.deadline_s, n=len(chunks) - i, once="deadline",
                                     space=binding.space.space_id, pair=binding.pair_id)
                return
            yield i, chunk

    def _observe(self, binding: Binding, chunks: Sequence[CodeChunk], started: float) -> None:
        if chunks:
            self.stats.observe("decode", time.perf_counter() - started, pair=binding.pair_id)

    def _refused(self, binding: Binding, chunk: CodeChunk, exc: PayloadError) -> None:
        self.stats.inc("refused_chunks", tier=chunk.tier, space=binding.space.space_id, pair=binding.pair_id)
        log.warning("scd-store: chunk %s refused (a miss from here on): %s", chunk.key, exc)

    def _decode(self, binding: Binding, chunk: CodeChunk, buffers: tuple[torch.Tensor, torch.Tensor] | None,
                device: torch.device, dtype: torch.dtype, heads: HeadShare | None = None) -> KVState | None:
        """One chunk's state, or None when the codec refuses it (counted and logged)."""
        try:  # the blob header's token count (bounded by the store) bounds the decode before it allocates
            if buffers is None:  # no copy: unpack takes views
                state = binding.codec.decode(payload_on(chunk, device), device=device, dtype=dtype,
                                             expect_tokens=chunk.token_count)
            else:  # the buffers' device is the decode's
                state = binding.codec.decode_into(payload_on(chunk, buffers[0].device), *buffers,
                                                  expect_tokens=chunk.token_count, heads=heads)
            if state.num_tokens != chunk.token_count:  # a second line of defence
                raise PayloadError(f"it decodes to {state.num_tokens} tokens; its header says {chunk.token_count}")
        except PayloadError as exc:
            self._refused(binding, chunk, exc)
            return None
        return state
