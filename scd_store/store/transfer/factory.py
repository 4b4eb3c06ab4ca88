"""Pick NIXL when it is installed and works here, else the in-process copy."""

from __future__ import annotations

import functools
import logging

import torch

from scd_store.store.transfer.base import BlobReader, BlobSource

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


def make_reader(device: torch.device | str = "cpu", kind: str = "auto") -> BlobReader:
    """A reader for sources of the same ``kind``."""
    if kind == "nixl" or (kind == "auto" and nixl_available()):
        from scd_store.store.transfer.nixl_transfer import NixlBlobReader

        return NixlBlobReader(device)
    from scd_store.store.transfer.copy_transfer import CopyBlobReader

    return CopyBlobReader()
