"""Range-coded payload sections ("ans-1"): a code space's integer codes, ANS-coded against probability
tables the space keeps (one per component, over its ``2^w`` codes; nothing per payload).

Codes of every sent component (width > 0) are coded component-major with ``constriction``'s ANS
coder; the payload also carries an xxh3 digest of those codes, so a stream that still decodes (an
empty one, a flipped word) but to other codes is refused. Used by entropy-coded quantisers
(:mod:`~scd_store.codecs.scd.ecsq`) and by fixed-rate spaces that keep tables for their codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from scd_store.errors import ScdStoreError

PACKING = "ans-1"
FLOOR = 1e-3  # share of each table spread evenly over its codes: every code stays codable (unseen: ~10 + w bits)
MAX_WIDTH = 8


class RangeCodingError(ScdStoreError, ValueError):
    """Coded words that do not decode to a whole payload against the space's tables."""


def codes_digest(codes: np.ndarray) -> str:
    """xxh3-64 of component-major uint8 codes: a range-coded payload carries it for its decoded codes."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(codes, dtype=np.uint8).tobytes())


def floored(p: torch.Tensor, size: int | torch.Tensor) -> torch.Tensor:
    """Probabilities ``p`` over ``size`` codes with :data:`FLOOR` of the mass spread evenly: what the coder uses."""
    return p * (1 - FLOOR) + FLOOR / size


def count_tables(codes: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Floored probability tables (flat float32, sent components in order) of sample codes ``[T, n]``."""
    tables = []
    for j in widths.nonzero().flatten().tolist():
        counts = torch.bincount(codes[:, j].to(torch.int64), minlength=1 << int(widths[j])).double()
        tables.append(floored(counts / counts.sum(), counts.numel()).float())
    return torch.cat(tables).float() if tables else torch.zeros(0)


@dataclass(slots=True)
class CodeTables:
    """Per component: its code width (0: not sent) and a probability table over its ``2^w`` codes."""

    widths: torch.Tensor  # [n] integer, 0..8
    probabilities: torch.Tensor  # [sum(2^widths of sent components)] float32, each component's table in turn
    _models: list | None = field(default=None, init=False, repr=False)
    _least: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name, dtypes in (("widths", (torch.int64, torch.int32, torch.uint8)), ("probabilities", (torch.float32,))):
            tensor = getattr(self, name)
            if tensor.dtype not in dtypes or tensor.dim() != 1:
                raise ValueError(f"code tables' {name} must be a flat tensor of {dtypes}, got {tensor.dtype} "
                                 f"{tuple(tensor.shape)}")
        self.widths = self.widths.to(torch.int64)
        if bool(((self.widths < 0) | (self.widths > MAX_WIDTH)).any()):
            raise ValueError(f"code widths must be within 0..{MAX_WIDTH}")
        expected = int((1 << self.widths[self.widths > 0]).sum())
        if self.probabilities.numel() != expected:
            raise ValueError(f"code tables hold {self.probabilities.numel()} probabilities, the widths need {expected}")
        if not bool(torch.isfinite(self.probabilities).all()) or bool((self.probabilities <= 0).any()):
            raise ValueError("code tables' probabilities must be finite and positive")

    @property
    def sent(self) -> torch.Tensor:
        return self.widths > 0

    def tables(self) -> list[torch.Tensor]:
        """Each sent component's normalised table, in component order."""
        sizes = (1 << self.widths[self.sent]).tolist()
        return [t / t.sum() for t in torch.split(self.probabilities.double(), sizes)]

    def mean_rate(self) -> float:
        """The tables' entropy in bits per component (over every component, sent or not): what a
        range-coded payload spends per element on text like the tables' own."""
        bits = sum(float(-(t * torch.log2(t)).sum()) for t in self.tables())
        return bits / self.widths.numel()

    def least_bits(self, tokens: int) -> float:
        """The fewest bits any ``tokens`` codes of every sent component can take: ``tokens`` times the sum of
        each table's ``-log2(max p)`` (a stream shorter than this cannot hold a payload: refused unread)."""
        if self._least is None:
            self._least = sum(float(-torch.log2(t.max())) for t in self.tables())
        return tokens * self._least

    def _coder_models(self) -> list:
        if self._models is None:
            import constriction  # the Rust extension exposes its submodules as attributes only

            categorical = constriction.stream.model.Categorical
            self._models = [categorical(t.numpy(), perfect=False) for t in self.tables()]
        return self._models

    def encode_codes(self, codes: torch.Tensor) -> tuple[torch.Tensor, str]:
        """ANS-coded words (int32 view of uint32) of codes ``[T, n]`` (every component; only sent ones are
        coded), and the digest of the sent codes that :meth:`decode_codes` checks."""
        import constriction

        sent = self.sent.nonzero().flatten().tolist()
        columns = np.ascontiguousarray(codes.cpu().numpy()[:, sent].T)  # [n_sent, T] uint8, component-major
        coder = constriction.stream.stack.AnsCoder()
        models = self._coder_models()
        for i in reversed(range(len(sent))):  # a stack: the last pushed is the first decoded
            coder.encode_reverse(columns[i].astype(np.int32), models[i])
        words = torch.from_numpy(coder.get_compressed().astype(np.uint32).view(np.int32).copy())
        return words, codes_digest(columns)

    def decode_codes(self, words: torch.Tensor, tokens: int, digest: str) -> torch.Tensor:
        """Invert :meth:`encode_codes`: codes ``[n_sent, tokens]`` (uint8, sent components in order).
        Raises :class:`RangeCodingError` unless the words decode to exactly that many codes with that digest
        (damaged words decode to other codes, or stop short, or leave words over: all refused)."""
        import constriction

        if words.dtype != torch.int32 or words.dim() != 1:
            raise RangeCodingError("range-coded words must be a flat int32 tensor")
        if 32 * words.numel() + 64 < 0.99 * self.least_bits(tokens):  # before a chunk's worth of decoding
            raise RangeCodingError(f"{words.numel()} range-coded words cannot hold {tokens} tokens of codes")
        models = self._coder_models()
        out = np.empty((len(models), tokens), dtype=np.uint8)
        try:
            coder = constriction.stream.stack.AnsCoder(words.cpu().numpy().view(np.uint32).copy())
            for i, model in enumerate(models):
                out[i] = coder.decode(model, tokens)
            if not coder.is_empty():
                raise RangeCodingError("range-coded words hold more than the payload's codes")
        except (ValueError, RuntimeError, AssertionError, OverflowError) as exc:
            if isinstance(exc, RangeCodingError):
                raise
            raise RangeCodingError(f"range-coded words do not decode: {exc}") from None
        if codes_digest(out) != digest:
            raise RangeCodingError("range-coded words decode to other codes than were written")
        return torch.from_numpy(out)
