"""Fixed-length token windows of a text: a built-in corpus's split, or a user's own text."""

from __future__ import annotations

import random

import torch

from scd_store.models.corpora import documents
from scd_store.models.user_text import UserText

Corpus = str | UserText  # a built-in corpus name ("shakespeare", "python") or a user's text


def corpus_name(corpus: Corpus) -> str:
    """How reports and bundles name a text."""
    return corpus if isinstance(corpus, str) else corpus.name


def token_streams(tokenizer, corpus: Corpus, split: str, length: int) -> list[list[int]]:
    """Token streams windows are cut from. A built-in corpus: one per document. A user's text: one per
    document of at least ``length`` tokens, the shorter ones (chat turns, short notes) packed into
    one stream, separated by the tokenizer's end-of-sequence token."""
    if isinstance(corpus, str):
        return [tokenizer(doc.text, add_special_tokens=False)["input_ids"] for doc in documents(corpus, split)]
    streams, packed = [], []
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for doc in corpus.documents():
        ids = tokenizer(doc.render(tokenizer), add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            streams.append(ids)
        else:
            packed.extend([*ids, *separator])
    return [*streams, packed] if packed else streams


def window_starts(streams: list[list[int]], length: int) -> list[tuple[int, int]]:
    """Every non-overlapping ``(stream, start)`` of a ``length``-token window."""
    return [(i, start) for i, ids in enumerate(streams) for start in range(0, len(ids) - length + 1, length)]


def count_windows(tokenizer, corpus: Corpus, length: int, split: str = "eval") -> int:
    """How many non-overlapping windows of ``length`` tokens the text holds."""
    return len(window_starts(token_streams(tokenizer, corpus, split, length), length))


def eval_windows(tokenizer, corpus: Corpus, count: int, length: int, seed: int, split: str = "eval"
                 ) -> list[torch.Tensor]:
    """``count`` non-overlapping windows of ``length`` token ids, drawn reproducibly by ``seed`` (a
    user's text has no splits: all of it is read, whatever ``split`` says)."""
    streams = token_streams(tokenizer, corpus, split, length)
    candidates = window_starts(streams, length)
    if len(candidates) < count:
        where = f"corpus {corpus!r} split {split!r}" if isinstance(corpus, str) else corpus.name
        raise ValueError(f"{where} has only {len(candidates)} windows of {length} tokens, {count} asked")
    chosen = sorted(random.Random(seed).sample(candidates, count))
    return [torch.tensor(streams[d][s : s + length], dtype=torch.long) for d, s in chosen]
