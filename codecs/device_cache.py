"""Device caches several CUDA streams read: :func:`published`.

A codec builds its folded matrices, RoPE tables and aligners once per device and keeps them for
every later decode, and those decodes may run on other CUDA streams (vLLM's fetch thread, SGLang's
prefetch threads, the engine's own stream). A stream reading an entry whose building kernels have
not run yet would read garbage, so an entry is handed out only once the stream that built it has
finished it (a one-time wait per entry). On the CPU nothing waits. An entry is never built inside a
CUDA-graph capture (its kernels would be recorded, not run): the graphs' warm-up decodes first.
"""

from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T")


def published(entry: T, device: torch.device | str) -> T:
    """``entry`` (tensors built on ``device`` by the current stream), complete for any stream to read.
    Raises ``RuntimeError`` inside a CUDA-graph capture (the capture fails: that shape decodes eagerly)."""
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a codec's device cache entry was built inside a CUDA-graph capture: warm the "
                                   "codec up eagerly before capturing")
        torch.cuda.current_stream(device).synchronize()
    return entry
