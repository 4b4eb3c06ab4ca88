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


def _documents(tokenizer, corpus: Corpus, split: str) -> list[list[int]]:
    """Each document's token ids (a user's chat documents rendered with the tokenizer's template)."""
    if isinstance(corpus, str):
        return [tokenizer(doc.text, add_special_tokens=False)["input_ids"] for doc in documents(corpus, split)]
    return [tokenizer(doc.render(tokenizer), add_special_tokens=False)["input_ids"] for doc in corpus.documents()]


def _streams(docs: list[list[int]], packed: bool, separator: list[int], length: int) -> list[list[int]]:
    """Token streams windows are cut from: one per document, or (``packed``) one per document of at least
    ``length`` tokens and the shorter ones in one stream, ``separator`` after each."""
    if not packed:
        return docs
    short = [t for ids in docs if len(ids) < length for t in (*ids, *separator)]
    return [ids for ids in docs if len(ids) >= length] + ([short] if short else [])


def token_streams(tokenizer, corpus: Corpus, split: str, length: int) -> list[list[int]]:
    """Token streams windows are cut from. A built-in corpus: one per document. A user's text: one per
    document of at least ``length`` tokens, the shorter ones (chat turns, short notes) packed into
    one stream, separated by the tokenizer's end-of-sequence token."""
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return _streams(_documents(tokenizer, corpus, split), not isinstance(corpus, str), separator, length)


def window_starts(streams: list[list[int]], length: int) -> list[tuple[int, int]]:
    """Every non-overlapping ``(stream, start)`` of a ``length``-token window."""
    return [(i, start) for i, ids in enumerate(streams) for start in range(0, len(ids) - length + 1, length)]


def count_windows(tokenizer, corpus: Corpus, lengths: tuple[int, ...], split: str = "eval") -> dict[int, int]:
    """How many non-overlapping windows of each of ``lengths`` tokens the text holds (tokenised once)."""
    docs = _documents(tokenizer, corpus, split)
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    packed = not isinstance(corpus, str)
    return {n: len(window_starts(_streams(docs, packed, separator, n), n)) for n in lengths}


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
