"""Pick NIXL when it is installed and works here, else the in-process copy."""

from __future__ import annotations

import functools
import logging

import torch

from scd_store.store.transfer.base import DEFAULT_MAX_BATCH_BYTES, BlobReader, BlobSource

log = logging.getLogger("scd_store.transfer")


@functools.cache
def nixl_available() -> bool:
    """True when ``nixl`` imports and can build a UCX agent."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config

        nixl_agent("scd-probe", nixl_agent_config(backends=["UCX"]))
        return True
    except Exception as exc:  # ImportError, or no UCX plugin
        log.info("NIXL is not usable here (%s): using the in-process copy transfer", exc)
        return False


def make_source(size: int, device: torch.device | str = "cpu", kind: str = "auto") -> BlobSource:
    """A blob source of ``size`` bytes: ``kind`` is ``nixl``, ``copy`` or ``auto``."""
    if kind == "nixl" or (kind == "auto" and nixl_available()):
        from scd_store.store.transfer.nixl_transfer import NixlBlobSource

        return NixlBlobSource(size, device)
    from scd_store.store.transfer.copy_transfer import CopyBlobSource

    return CopyBlobSource(size, device)


def make_reader(device: torch.device | str = "cpu", kind: str = "auto", *,
                max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES, initial_bytes: int = 1 << 20) -> BlobReader:
    """A reader for sources of the same ``kind``: at most ``max_batch_bytes`` per transfer; a NIXL reader's
    registered buffer is ``initial_bytes`` between reads (grown for a read, up to ``max_batch_bytes``)."""
    if kind == "nixl" or (kind == "auto" and nixl_available()):
        from scd_store.store.transfer.nixl_transfer import NixlBlobReader

        return NixlBlobReader(device, initial_bytes=min(initial_bytes, max_batch_bytes),
                              max_batch_bytes=max_batch_bytes)
    from scd_store.store.transfer.copy_transfer import CopyBlobReader

    return CopyBlobReader(max_batch_bytes)
