"""Calibration text: windows of a corpus's calibration splits (never its evaluation split)."""

from __future__ import annotations

import torch

from scd_store.models.windows import Corpus, eval_windows


def calibration_windows(tokenizer, corpus: Corpus, count: int, length: int, seed: int, splits: tuple[str, ...]
                        ) -> list[torch.Tensor]:
    """``count`` windows of ``length`` tokens spread evenly over ``splits`` of ``corpus`` (a user's text: all of it)."""
    if "eval" in splits:
        raise ValueError("calibration never reads the eval split")
    shares = [count // len(splits) + (i < count % len(splits)) for i in range(len(splits))]
    return [w for split, share in zip(splits, shares, strict=True) if share
            for w in eval_windows(tokenizer, corpus, share, length, seed, split=split)]
