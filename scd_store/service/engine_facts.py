"""What one engine adapter learned about this process's engine, for another adapter in the same process.

The vLLM connector that runs LMCache (``LMCacheCpuConnector`` / ``LMCacheGpuConnector``) knows whether vLLM
serves LoRA adapters; the scd-store LMCache plugin that LMCache builds inside it must know too (LMCache keys
carry no LoRA id, so such an engine never writes codes). Adapters do not import each other; they meet here,
in this process's memory (never the environment, which child processes would inherit).
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_serves_lora = False


def mark_serves_lora() -> None:
    """This process's engine serves LoRA adapters (for good: an engine does not stop serving them)."""
    global _serves_lora
    with _lock:
        _serves_lora = True


def serves_lora() -> bool:
    """Whether an adapter of this process said its engine serves LoRA adapters."""
    return _serves_lora
