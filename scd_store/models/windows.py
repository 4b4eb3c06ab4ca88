"""Held-out evaluation windows: fixed-length token slices of a corpus's ``eval`` split."""

from __future__ import annotations

import random

import torch

from scd_store.models.corpora import documents


def eval_windows(tokenizer, corpus: str, count: int, length: int, seed: int, split: str = "eval") -> list[torch.Tensor]:
    """``count`` non-overlapping windows of ``length`` token ids, drawn reproducibly by ``seed``."""
    candidates: list[tuple[int, int]] = []
    streams: list[list[int]] = []
    for doc in documents(corpus, split):
        ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        streams.append(ids)
        candidates.extend((len(streams) - 1, start) for start in range(0, len(ids) - length + 1, length))
    if len(candidates) < count:
        raise ValueError(f"corpus {corpus!r} split {split!r} has only {len(candidates)} windows of {length} tokens, "
                         f"{count} asked")
    chosen = sorted(random.Random(seed).sample(candidates, count))
    return [torch.tensor(streams[d][s : s + length], dtype=torch.long) for d, s in chosen]
