"""The hashing canary of this SGLang engine process, :func:`sglang_canary`: its own page hash chain over the
canary tokens."""

from __future__ import annotations

from scd_store.adapters.sglang.pages import page_hash_bytes
from scd_store.service.hash_agreement import HashCanary, canary_tokens, package_version


def sglang_canary(page_size: int) -> HashCanary:
    """SGLang's SHA-256 page chain (``get_hash_str``) over the canary tokens, at ``page_size``."""
    from sglang.srt.mem_cache.utils import get_hash_str

    last = get_hash_str(canary_tokens(page_size), None, page_size=page_size)[-1]
    return HashCanary("sglang", page_size, page_hash_bytes(last).hex(), {"sglang": package_version("sglang")})
