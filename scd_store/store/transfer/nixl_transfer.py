"""NIXL (UCX) transfer: a consumer's agent READs blobs straight out of a producer agent's registered memory."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence

import torch

from scd_store.store.transfer.arena import Arena
from scd_store.store.transfer.base import BlobReader, BlobRef, BlobSource, SourceInfo, TransferError

log = logging.getLogger("scd_store.transfer")


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


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
    """Reads many blobs per transfer into one registered local buffer (grown on demand)."""

    def __init__(self, device: torch.device | str = "cpu", name: str | None = None,
                 initial_bytes: int = 1 << 20) -> None:
        self.name = name or f"scd-rd-{uuid.uuid4().hex[:12]}"
        self.device = torch.device(device)
        self.agent = _agent(self.name)
        self._peers: dict[str, tuple[str, SourceInfo]] = {}
        self._buffer: torch.Tensor | None = None
        self._reg = None
        self._abandoned: list = []  # buffers an unfinished transfer may still write into: never reused
        self._ensure(initial_bytes)
        self.lock = threading.Lock()

    def _ensure(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            if self._reg is not None:
                self.agent.deregister_memory(self._reg)
            size = max(nbytes, 2 * (self._buffer.numel() if self._buffer is not None else 0))
            self._buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._reg = self.agent.register_memory(self._buffer)
        return self._buffer

    def _abandon_buffer(self) -> None:
        self._abandoned.append((self._buffer, self._reg))
        self._buffer, self._reg = None, None

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
        self._peers[info.name] = (remote, info)
        return info.name

    def read(self, source: str, refs: Sequence[BlobRef], timeout_s: float = 2.0) -> list[bytes | None]:
        with self.lock:
            return [bytes(v) if v is not None else None for v in self._read_views(source, refs, timeout_s)]

    def read_views(self, source: str, refs: Sequence[BlobRef], timeout_s: float = 2.0) -> list[memoryview | None]:
        """Like :meth:`read` without copying out (DRAM readers): views valid until the next read."""
        with self.lock:
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
        if not self._transfer(remote, local, remote_descs, info.mem_type, timeout_s):
            return [None] * len(refs)
        host = buffer[:total] if buffer.device.type == "cpu" else buffer[:total].cpu()
        view = memoryview(host.numpy())
        for (i, r), off in zip(wanted, offsets, strict=True):
            out[i] = view[off:off + r.length]
        return out

    def _transfer(self, remote: str, local: list, remote_descs: list, remote_mem: str, timeout_s: float) -> bool:
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
            while state == "PROC" and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
        except Exception as exc:
            log.warning("nixl read from %s failed: %s", remote, exc)
            state = "ERR"
        if state == "PROC":
            log.warning("nixl read from %s timed out after %.2f s: miss", remote, timeout_s)
            self._abandon_buffer()
            self._abandoned.append(handle)
            return False
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:
            log.debug("nixl release failed: %s", exc)
        if state != "DONE":
            log.warning("nixl read from %s failed (state %s): miss", remote, state)
        return state == "DONE"

    def close(self) -> None:
        if self._reg is not None:
            try:
                self.agent.deregister_memory(self._reg)
            except Exception as exc:
                log.debug("nixl deregister failed: %s", exc)
            self._reg = None
