"""NIXL (UCX) transfer: a consumer's agent READs blobs straight out of a producer agent's registered memory."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence

import torch

from scd_store.store.transfer.arena import Arena
from scd_store.store.transfer.base import (
    DEFAULT_MAX_BATCH_BYTES,
    BlobReader,
    BlobRef,
    BlobSource,
    SourceInfo,
    TransferError,
    split_batches,
)

log = logging.getLogger("scd_store.transfer")
# NIXL's progress thread waits up to this long for UCX's events between rounds. Its Python API sets 0, and
# then the thread never sleeps: one core per agent, busy while idle (NIXL 1.5; every producer process
# publishing a peer arena, and every reader). Measured on cpu-epyc-avx512-2c: idle 100% of a core at 0,
# 0.1% at 100 ms; 1-64 MiB READs over UCX's TCP 1.05 GB/s at 0 and 1.2 GB/s at 100 ms (the thread wakes
# on events, so a wait costs no transfer speed), over its shared-memory transports about the same.
PROGRESS_WAIT_US = 100_000
# A reader checks its transfer this many times back to back (a local read is done by then), then sleeps
# between checks, 50 us doubling to 1 ms: a read that crosses a slow link no longer spins a core for its
# whole length, which on a small host starved the very source it waited for (both engines' workers are
# pinned to one core by vLLM-CPU).
SPIN_POLLS = 64
POLL_SLEEP_MIN_S, POLL_SLEEP_MAX_S = 50e-6, 1e-3
_AGENT_LOCK = threading.Lock()


def _agent(name: str):
    """A NIXL agent with the UCX backend whose progress thread waits for events (:data:`PROGRESS_WAIT_US`)."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise TransferError("transfer: nixl needs NIXL: pip install 'scd-store[nixl]' (or use transfer: copy / "
                            f"auto): {exc}") from exc

    api = sys.modules[nixl_agent.__module__]  # the module whose nixlBind.nixlAgent the constructor calls
    bind = api.nixlBind
    make = bind.nixlAgent

    def waiting(agent_name: str, config: object) -> object:
        if hasattr(config, "pthrDelay"):
            config.pthrDelay = PROGRESS_WAIT_US
        return make(agent_name, config)

    with _AGENT_LOCK:  # the constructor's one call to nixlBind.nixlAgent gets the wait, nothing else does
        bind.nixlAgent = waiting
        try:
            return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        finally:
            bind.nixlAgent = make


class NixlBlobSource(BlobSource):
    """Blobs in an arena registered with a NIXL agent (DRAM, or VRAM when ``device`` is CUDA)."""

    def __init__(self, size: int, device: torch.device | str = "cpu", name: str | None = None) -> None:
        self.name = name or f"scd-src-{uuid.uuid4().hex[:12]}"
        self.arena = Arena(size, device)
        self.agent = _agent(self.name)
        self._reg = self.agent.register_memory(self.arena.buffer)
        self.lock = threading.Lock()

    def publish(self, blobs: Mapping[str, bytes]) -> list[BlobRef]:
        with self.lock:
            refs = self.arena.put(blobs)
        if self.arena.buffer.is_cuda:
            torch.cuda.synchronize(self.arena.buffer.device)
        return refs

    def info(self) -> SourceInfo:
        return SourceInfo(self.name, "nixl", self.arena.mem_type, self.arena.buffer.data_ptr(), self.arena.size,
                          self.arena.device_id, self.agent.get_agent_metadata())

    def close(self) -> None:
        reg, self._reg = self._reg, None
        if reg is not None:
            try:
                self.agent.deregister_memory(reg)
            except Exception as exc:  # closing must not raise
                log.debug("nixl deregister failed: %s", exc)


class NixlBlobReader(BlobReader):
    """Reads many blobs per transfer into one registered local buffer.

    A transfer moves at most ``max_batch_bytes``: :meth:`read` splits a larger batch, and the buffer,
    grown for a read past ``initial_bytes``, shrinks back to ``initial_bytes`` when that read is done.
    A transfer that times out keeps its buffer (the peer may still write into it) until NIXL says it
    ended; while a source holds ``MAX_ABANDONED_PER_SOURCE`` of them (or all sources ``MAX_ABANDONED``),
    reads from it (from all) are misses: memory stays bounded and one hung peer does not stop the others."""

    MAX_ABANDONED_PER_SOURCE = 2
    MAX_ABANDONED = 8

    def __init__(self, device: torch.device | str = "cpu", name: str | None = None,
                 initial_bytes: int = 1 << 20, max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES) -> None:
        if not 0 < initial_bytes <= max_batch_bytes:
            raise TransferError(f"need 0 < initial_bytes <= max_batch_bytes, got {initial_bytes}, {max_batch_bytes}")
        self.name = name or f"scd-rd-{uuid.uuid4().hex[:12]}"
        self.device = torch.device(device)
        self.agent = _agent(self.name)
        self.initial_bytes = initial_bytes
        self.max_batch_bytes = max_batch_bytes
        self.transfers = 0
        self._peers: dict[str, tuple[str, SourceInfo]] = {}
        self._buffer: torch.Tensor | None = None
        self._reg = None
        self._abandoned: list[tuple[str, object, torch.Tensor | None, object]] = []  # (source, handle, buffer, reg)
        self._ensure(initial_bytes)
        self.lock = threading.Lock()

    @property
    def buffer_bytes(self) -> int:
        """The size of the registered local buffer now."""
        return self._buffer.numel() if self._buffer is not None else 0

    def _register(self, nbytes: int) -> torch.Tensor:
        self._release()
        self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._reg = self.agent.register_memory(self._buffer)
        return self._buffer

    def _release(self) -> None:
        reg, self._reg, self._buffer = self._reg, None, None
        if reg is not None:
            try:
                self.agent.deregister_memory(reg)
            except Exception as exc:
                log.debug("nixl deregister failed: %s", exc)

    def _ensure(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            return self._register(max(nbytes, self.initial_bytes))
        return self._buffer

    def _shrink(self) -> None:
        if self._buffer is not None and self._buffer.numel() > self.initial_bytes:
            try:
                self._register(self.initial_bytes)
            except Exception as exc:  # the next read registers what it needs
                log.debug("nixl: cannot register the initial buffer again: %s", exc)
                self._release()

    def _abandon(self, source: str, handle: object) -> None:
        self._abandoned.append((source, handle, self._buffer, self._reg))
        self._buffer, self._reg = None, None

    def _reap(self) -> None:
        """Free the buffers of timed-out transfers that NIXL reports ended."""
        kept = []
        for source, handle, buffer, reg in self._abandoned:
            try:
                ended = self.agent.check_xfer_state(handle) != "PROC"
                if ended:
                    self.agent.release_xfer_handle(handle)
            except Exception as exc:  # cannot tell or cannot release: keep holding the buffer
                log.debug("nixl: an abandoned transfer is not released yet: %s", exc)
                ended = False
            if not ended:
                kept.append((source, handle, buffer, reg))
            elif reg is not None:
                try:
                    self.agent.deregister_memory(reg)
                except Exception as exc:
                    log.debug("nixl deregister failed: %s", exc)
        self._abandoned = kept

    @property
    def _mem_type(self) -> str:
        return "VRAM" if self.device.type == "cuda" else "DRAM"

    def connect(self, info: SourceInfo | bytes) -> str:
        info = SourceInfo.from_bytes(info) if isinstance(info, bytes) else info
        if info.kind != "nixl":
            raise TransferError(f"the NIXL reader cannot reach a {info.kind!r} source")
        try:
            remote = self.agent.add_remote_agent(info.agent_metadata)
        except Exception as exc:
            raise TransferError(f"cannot add NIXL agent {info.name!r}: {exc}") from exc
        remote = remote.decode() if isinstance(remote, bytes) else remote
        if remote != info.name:  # metadata of another agent than the source it claims to be
            if remote not in {r for r, _ in self._peers.values()}:
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(remote)
            raise TransferError(f"source {info.name!r}'s agent metadata names agent {remote!r}")
        self._peers[info.name] = (remote, info)
        return info.name

    def read(self, source: str, refs: Sequence[BlobRef], timeout_s: float = 2.0) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(refs)
        deadline = time.monotonic() + timeout_s
        with self.lock:
            try:
                for group in split_batches(refs, self.max_batch_bytes):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    views = self._read_views(source, [refs[i] for i in group], left)
                    for i, view in zip(group, views, strict=True):  # copied out before the next transfer
                        out[i] = bytes(view) if view is not None else None
            finally:
                self._shrink()
        return out

    def read_views(self, source: str, refs: Sequence[BlobRef], timeout_s: float = 2.0) -> list[memoryview | None]:
        """Like :meth:`read` without copying out (DRAM readers), in one transfer of at most ``max_batch_bytes``
        (all None for a larger batch): views valid until the next read."""
        with self.lock:
            if sum(r.length for r in refs) > self.max_batch_bytes:
                log.warning("nixl read_views: %d refs need more than %d bytes: miss", len(refs), self.max_batch_bytes)
                return [None] * len(refs)
            return self._read_views(source, refs, timeout_s)

    def _read_views(self, source: str, refs: Sequence[BlobRef], timeout_s: float) -> list[memoryview | None]:
        if source not in self._peers:
            log.warning("nixl read from unknown source %r: miss", source)
            return [None] * len(refs)
        remote, info = self._peers[source]
        if any(r.offset + r.length > info.size for r in refs):
            log.warning("nixl read: refs outside source %r's region: miss", source)
            return [None] * len(refs)
        wanted = [(i, r) for i, r in enumerate(refs) if r.length]
        out: list[memoryview | None] = [memoryview(b"") if not r.length else None for r in refs]
        if not wanted:
            return out
        total = sum(r.length for _, r in wanted)
        self._reap()
        held = sum(a[0] == source for a in self._abandoned)
        if held >= self.MAX_ABANDONED_PER_SOURCE or len(self._abandoned) >= self.MAX_ABANDONED:
            log.warning("nixl read: %d timed-out transfers (%d from %s) still hold their buffers: miss",
                        len(self._abandoned), held, source)
            return [None] * len(refs)
        try:
            buffer = self._ensure(total)
        except Exception as exc:
            log.warning("nixl read: cannot register a %d-byte buffer: %s", total, exc)
            return [None] * len(refs)
        base = buffer.data_ptr()
        dev = (self.device.index or 0) if self.device.type == "cuda" else 0
        local, remote_descs, offsets, pos = [], [], [], 0
        for _, r in wanted:
            local.append((base + pos, r.length, dev))
            remote_descs.append((info.base + r.offset, r.length, info.device_id))
            offsets.append(pos)
            pos += r.length
        if not self._transfer(source, remote, local, remote_descs, info.mem_type, timeout_s):
            return [None] * len(refs)
        host = buffer[:total] if buffer.device.type == "cpu" else buffer[:total].cpu()
        view = memoryview(host.numpy())
        for (i, r), off in zip(wanted, offsets, strict=True):
            out[i] = view[off:off + r.length]
        return out

    def _transfer(self, source: str, remote: str, local: list, remote_descs: list, remote_mem: str,
                  timeout_s: float) -> bool:
        self.transfers += 1
        try:
            local_dl = self.agent.get_xfer_descs(local, self._mem_type)
            remote_dl = self.agent.get_xfer_descs(remote_descs, remote_mem)
            handle = self.agent.initialize_xfer("READ", local_dl, remote_dl, remote)
        except Exception as exc:
            log.warning("nixl read from %s could not start: %s", remote, exc)
            return False
        deadline = time.monotonic() + timeout_s
        try:
            state = self.agent.transfer(handle)
            polls = 0
            while state == "PROC" and time.monotonic() < deadline:
                polls += 1
                if polls > SPIN_POLLS:  # a transfer still going after the spins sleeps between checks
                    time.sleep(min(POLL_SLEEP_MAX_S, POLL_SLEEP_MIN_S * 2 ** min(polls - SPIN_POLLS, 16)))
                state = self.agent.check_xfer_state(handle)
        except Exception as exc:
            log.warning("nixl read from %s failed: %s", remote, exc)
            state = "ERR"
        if state == "PROC":
            log.warning("nixl read from %s timed out after %.2f s: miss", remote, timeout_s)
            self._abandon(source, handle)
            return False
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:
            log.debug("nixl release failed: %s", exc)
        if state != "DONE":
            log.warning("nixl read from %s failed (state %s): miss", remote, state)
        return state == "DONE"

    def close(self) -> None:
        self._reap()
        self._release()
