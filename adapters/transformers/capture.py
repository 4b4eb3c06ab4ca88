"""Producer side: prefill a prefix and capture its KV (as cached) and, at chosen layers, ``H_in``."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import DynamicCache

from scd_store.adapters.transformers.compat import cache_kwarg
from scd_store.codecs.kv_state import KVState


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer list of a Llama-family causal LM."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no .model.layers; only decoder-only LMs are supported")
    return layers


@torch.no_grad()
def prefill_capture(model: torch.nn.Module, input_ids: torch.Tensor, hidden_layers: Iterable[int] = (),
                    residual_layers: Iterable[int] = (), last_logits_only: bool = False,
                    logits_to_keep: int = 0) -> tuple[KVState, torch.Tensor]:
    """Run the prefix ``input_ids`` (1-D) through ``model``; return its state and the logits ``[T, V]``
    (``[1, V]`` for the last token only with ``last_logits_only``, as a serving prefill computes;
    the last ``logits_to_keep`` tokens' with that > 0).

    ``H_in`` of layer ``i`` is the output of that layer's ``input_layernorm``, captured by a forward
    hook; the residual stream entering layer ``i`` by a forward pre-hook (no model code is copied).
    """
    if input_ids.dim() != 1 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty 1-D tensor of token ids, got shape {tuple(input_ids.shape)}")
    layers = decoder_layers(model)
    wanted, entering = sorted(set(hidden_layers)), sorted(set(residual_layers))
    for i in (*wanted, *entering):
        if not 0 <= i < len(layers):
            raise ValueError(f"hidden layer {i} outside 0..{len(layers) - 1}")
    captured: dict[int, torch.Tensor] = {}
    residual: dict[int, torch.Tensor] = {}
    handles = []
    for i in wanted:
        def hook(_module, _args, output, i=i):
            captured[i] = output[0].detach()
        handles.append(layers[i].input_layernorm.register_forward_hook(hook))
    for i in entering:
        def pre_hook(_module, args, kwargs, i=i):
            residual[i] = (args[0] if args else kwargs["hidden_states"])[0].detach()
        handles.append(layers[i].register_forward_pre_hook(pre_hook, with_kwargs=True))
    cache = DynamicCache()  # full KV in every layer (sliding-window layers too; their masks still slide)
    device = next(model.parameters()).device
    try:
        keep = 1 if last_logits_only else logits_to_keep
        extra = {"logits_to_keep": keep} if keep else {}
        out = model(input_ids=input_ids.to(device)[None], **{cache_kwarg(model): cache}, use_cache=True, **extra)
    finally:
        for handle in handles:
            handle.remove()
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return KVState(keys, values, captured, 0, residual), out.logits[0]
