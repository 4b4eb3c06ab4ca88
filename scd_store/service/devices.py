"""Where an engine adapter decodes (the ``decode_device`` setting): :func:`resolve_decode_device`, checked at
start so a device that is not here is a clear error, never a failure on the first request."""

from __future__ import annotations

from typing import Any

import torch

from scd_store.service.settings import SettingsError


def resolve_decode_device(setting: str, cuda: Any = torch.cuda) -> torch.device:
    """The device ``decode_device`` names, fixed now (bare ``cuda``: the calling thread's current device, since
    engines' I/O threads may never set theirs), or a :class:`SettingsError` naming the setting when it is not
    here. ``cuda`` stands for :mod:`torch.cuda` (tests pass another)."""
    device = torch.device(setting)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise SettingsError(f"decode_device must be cpu, cuda or cuda:N, got {setting!r}")
    if not cuda.is_available():
        raise SettingsError(f"decode_device is {setting!r} but CUDA is not available in this process "
                            "(torch.cuda.is_available() is false): set decode_device to cpu, or run where the GPU "
                            "is visible")
    index = cuda.current_device() if device.index is None else device.index
    if index >= cuda.device_count():
        raise SettingsError(f"decode_device is {setting!r} but this process sees {cuda.device_count()} CUDA "
                            "device(s)")
    return torch.device("cuda", index)
