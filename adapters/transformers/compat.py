"""Small shims over transformers versions."""

from __future__ import annotations

import inspect
from functools import cache

import torch


@cache
def _cache_kwarg_for(model_type: type) -> str:
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward() keyword that takes a KV cache: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    return _cache_kwarg_for(type(model))
