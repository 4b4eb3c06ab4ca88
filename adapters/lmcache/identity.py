"""Who a chunk belongs to, from an LMCache key: a model (engine model name, or the LoRA adapter a
request names) and a tenant namespace (the request's other ``lmcache.tag.*`` tags).

LMCache keys carry no LoRA id: a base engine that also serves adapters must say which model each
request is for, with the ``lmcache.tag.<model_tag>`` request tag (default ``scd_model``). With
``serves_adapters`` set, a request without it is *unattributed*: neither stored nor served, so an
adapter's KV is never coded as the base model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TAG = "lmcache.tag."
MODEL_TAG = "scd_model"


@dataclass(frozen=True, slots=True)
class ChunkIdentity:
    """``model`` None: the request cannot be attributed to a model."""

    model: str | None
    namespace: tuple[tuple[str, str], ...] = ()


def key_identity(key: Any, model_tag: str = MODEL_TAG, serves_adapters: bool = False) -> ChunkIdentity:
    """The identity of one LMCache ``CacheEngineKey``."""
    tags = {k[len(TAG):]: str(v) for k, v in (key.request_configs or {}).items() if k.startswith(TAG)}
    model = tags.pop(model_tag, None)
    if model is None and not serves_adapters:
        model = key.model_name
    return ChunkIdentity(model, tuple(sorted(tags.items())))


def batch_identity(keys: Sequence[Any], model_tag: str = MODEL_TAG, serves_adapters: bool = False
                   ) -> ChunkIdentity:
    """The identity shared by every key of a batch (unattributed when they differ)."""
    identities = {key_identity(k, model_tag, serves_adapters) for k in keys}
    return identities.pop() if len(identities) == 1 else ChunkIdentity(None)
