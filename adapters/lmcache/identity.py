"""Who a chunk belongs to, from an LMCache key (:func:`key_identity`, :func:`batch_identity`): a model and a
tenant namespace (the request's other ``lmcache.tag.*`` tags). Roles come from the engine, never from a request.

- An engine that serves no adapters (``serves_adapters`` false): the model is the engine's own
  (``key.model_name``, which LMCache fills from the engine's ``metadata.model_name``). A request's
  model tag ``lmcache.tag.<model_tag>`` (default ``scd_model``) naming another model is *ignored*:
  it selects no role and never enters the namespace (``ignored_tag`` says what it named).
- An engine that serves a base model and its LoRA adapters (``serves_adapters`` true): LMCache keys
  carry no LoRA id, so the tag (set by a gateway) may name one of the base model's registered
  consumers, which the request then reads as. Untagged, or naming the producer or any other model,
  the request is *unattributed* (``model`` None): neither stored nor served. Such an engine never
  produces: no request of it can be attributed to the base model by the engine itself.
- A request with a vLLM ``cache_salt`` carries ``lmcache.tag.scd_cache_salt`` (put there by
  :class:`scd_store.adapters.vllm.lmcache_cpu.LMCacheCpuConnector`, never by a client): LMCache's
  own tiers keep it apart, and scd-store neither stores nor serves it (``salted``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scd_store.service.defaults import MODEL_TAG

TAG = "lmcache.tag."
SALT_TAG = "scd_cache_salt"  # LMCacheCpuConnector's tag of a request's cache_salt (a SHA-256 prefix)


@dataclass(frozen=True, slots=True)
class ChunkIdentity:
    """``model`` None: the request cannot be attributed to a model. ``salted``: the request has a
    ``cache_salt`` (never stored or served). ``ignored_tag``: the model tag the engine ignored."""

    model: str | None
    namespace: tuple[tuple[str, str], ...] = ()
    salted: bool = False
    ignored_tag: str | None = None


def _never(name: str) -> bool:
    return False


def key_identity(key: Any, model_tag: str = MODEL_TAG, serves_adapters: bool = False,
                 is_adapter: Callable[[str], bool] = _never, aliases: Mapping[str, str] | None = None
                 ) -> ChunkIdentity:
    """The identity of one LMCache ``CacheEngineKey``. ``is_adapter(name)``: whether ``name`` is a
    registered consumer of the engine's own space (only asked on an engine that serves adapters);
    ``aliases`` map engine names to bundle names (a tag naming the engine's own model is not ignored)."""
    tags = {k[len(TAG):]: str(v) for k, v in (key.request_configs or {}).items()
            if isinstance(k, str) and k.startswith(TAG)}
    claimed = tags.pop(model_tag, None)  # never part of the namespace
    salted = tags.pop(SALT_TAG, None) is not None
    namespace = tuple(sorted(tags.items()))
    if serves_adapters:
        model = claimed if claimed is not None and is_adapter(claimed) else None
        return ChunkIdentity(model, namespace, salted)
    names = aliases or {}
    ignored = claimed if claimed is not None and names.get(claimed, claimed) != names.get(
        key.model_name, key.model_name) else None
    return ChunkIdentity(key.model_name, namespace, salted, ignored)


def batch_identity(keys: Sequence[Any], model_tag: str = MODEL_TAG, serves_adapters: bool = False,
                   is_adapter: Callable[[str], bool] = _never, aliases: Mapping[str, str] | None = None
                   ) -> ChunkIdentity:
    """The identity shared by every key of a batch (unattributed when they differ; salted when any is)."""
    answers: dict[str, bool] = {}

    def adapter(name: str) -> bool:  # asked once per name and batch
        if name not in answers:
            answers[name] = is_adapter(name)
        return answers[name]

    identities = {key_identity(k, model_tag, serves_adapters, adapter, aliases) for k in keys}
    if len(identities) == 1:
        return identities.pop()
    return ChunkIdentity(None, salted=any(i.salted for i in identities))
