"""Consumer side: inject prefix KV into a transformers cache and continue (logits or generation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from scd_store.adapters.transformers.compat import cache_kwarg
from scd_store.codecs.kv_state import KVState


class PrefixBuffer:
    """One prefix's KV for ``model`` (its device and dtype), filled chunk after chunk in place: pass it
    as ``KVService.get(..., into=buffer)``, so chunks decode straight into it (no concatenation)."""

    def __init__(self, model: torch.nn.Module, max_tokens: int) -> None:
        config, param = model.config, next(model.parameters())
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (config.num_hidden_layers, config.num_key_value_heads, max_tokens, head_dim)
        self.keys = torch.empty(shape, device=param.device, dtype=param.dtype)
        self.values = torch.empty(shape, device=param.device, dtype=param.dtype)
        self.handed_out = 0

    def __call__(self, index: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The next ``tokens`` positions' buffers (``index`` is the chunk's place in the run), or None when full."""
        start = self.handed_out
        if start + tokens > self.keys.shape[2]:
            return None
        self.handed_out += tokens
        return self.keys[:, :, start:start + tokens], self.values[:, :, start:start + tokens]

    def state(self, tokens: int) -> KVState | None:
        """The first ``tokens`` positions (the chunks the store returned) as a state, or None for none."""
        if not tokens:
            return None
        return KVState(self.keys[:, :, :tokens], self.values[:, :, :tokens])


def build_cache(model: torch.nn.Module, state: KVState | None) -> DynamicCache:
    """A transformers cache holding ``state`` (empty when ``state`` is None), on the model's device and dtype."""
    cache = DynamicCache()  # full KV in every layer (sliding-window layers too; their masks still slide)
    if state is None:
        return cache
    config = model.config
    expected = (config.num_hidden_layers, config.num_key_value_heads, getattr(config, "head_dim", None)
                or config.hidden_size // config.num_attention_heads)
    got = (state.num_layers, state.num_kv_heads, state.head_dim)
    if got != expected:
        raise ValueError(f"KV of shape (layers, kv_heads, head_dim) = {got} does not fit this model {expected}")
    param = next(model.parameters())
    for i in range(state.num_layers):
        k = state.keys[i].to(device=param.device, dtype=param.dtype)[None]
        v = state.values[i].to(device=param.device, dtype=param.dtype)[None]
        cache.update(k, v, i)
    return cache


@torch.no_grad()
def continue_with_prefix(model: torch.nn.Module, state: KVState | None, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[T, V]`` of ``input_ids`` (1-D) following the prefix held in ``state``.

    With ``state=None`` the tokens are run with no prefix at all (positions from 0).
    """
    if input_ids.dim() != 1 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty 1-D tensor of token ids, got shape {tuple(input_ids.shape)}")
    cache = build_cache(model, state)
    device = next(model.parameters()).device
    out = model(input_ids=input_ids.to(device)[None], **{cache_kwarg(model): cache}, use_cache=True)
    return out.logits[0]


@torch.no_grad()
def generate_greedy(model: torch.nn.Module, state: KVState | None, input_ids: torch.Tensor,
                    max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Greedy generation after the prefix in ``state`` and the prompt tail ``input_ids``."""
    if max_new_tokens <= 0:
        return []
    cache = build_cache(model, state)
    device = next(model.parameters()).device
    kwargs = {cache_kwarg(model): cache, "use_cache": True}
    logits = model(input_ids=input_ids.to(device)[None], **kwargs).logits[0, -1]
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits.argmax())
        generated.append(token)
        if eos_token_id is not None and token == eos_token_id:
            break
        logits = model(input_ids=torch.tensor([[token]], device=device), **kwargs).logits[0, -1]
    return generated


@torch.no_grad()
def greedy_logprobs(model: torch.nn.Module, state: KVState | None, input_ids: torch.Tensor,
                    max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens after the prefix in ``state`` and the tail ``input_ids``, and each one's log-probability
    (what an engine reports as a generated token's ``logprob``)."""
    tokens = generate_greedy(model, state, input_ids, max_new_tokens)
    if not tokens:
        return [], []
    ids = torch.cat([input_ids, torch.tensor(tokens[:-1], dtype=input_ids.dtype)])
    logits = continue_with_prefix(model, state, ids)[len(input_ids) - 1:]
    logprobs = F.log_softmax(logits.float(), -1)
    return tokens, [float(logprobs[i, t]) for i, t in enumerate(tokens)]


def mean_kl(logits: torch.Tensor, oracle: torch.Tensor) -> float:
    """Mean over positions of KL(oracle || logits), in nats (both ``[T, V]``)."""
    return float(F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(oracle.float(), -1), log_target=True,
                          reduction="none").sum(-1).mean())
