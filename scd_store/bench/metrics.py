"""Continuation metrics against the oracle: perplexity, KL divergence, greedy top-1 agreement, and how far
two greedy answers agree."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens ``a`` shares with ``b`` before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass(slots=True)
class ContinuationScore:
    """Running sums over scored tokens for one method, and each :meth:`add` call's (a window's) means."""

    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    tokens: int = 0
    payload_bytes: int = 0
    prefix_tokens: int = 0
    windows: list[tuple[float, float, float]] = field(default_factory=list)  # per call: (nll, kl, top1) means

    def add(self, logits: torch.Tensor, oracle_logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Score ``logits`` ``[T, V]`` against the oracle's and the true next tokens ``[T]``."""
        logp = F.log_softmax(logits.float(), dim=-1)
        logq = F.log_softmax(oracle_logits.float(), dim=-1)
        nll = float(-logp.gather(1, targets[:, None].to(logp.device)).sum())
        kl = float((logq.exp() * (logq - logp)).sum())
        top1 = int((logp.argmax(-1) == logq.argmax(-1)).sum())
        n = targets.numel()
        self.nll, self.kl, self.top1, self.tokens = self.nll + nll, self.kl + kl, self.top1 + top1, self.tokens + n
        self.windows.append((nll / n, kl / n, top1 / n))

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def mean_kl(self) -> float:
        return self.kl / self.tokens

    @property
    def top1_rate(self) -> float:
        return self.top1 / self.tokens

    @property
    def bytes_per_token(self) -> float:
        return self.payload_bytes / self.prefix_tokens if self.prefix_tokens else 0.0
