"""Entropy-coded scalar quantisers (ECSQ) over a code space's basis, and their range-coded payload.

Each component ``j`` gets a uniform mid-tread quantiser of step ``steps[j]`` (index
``round(z / step)``, a zero bin, reconstruction at ``index * step``) whose indices are stored as
codes ``index + 2^(w_j - 1)`` of container width ``w_j`` (2..8 bits; indices past it are clamped),
and a probability table over those ``2^w_j`` codes. Steps are chosen on the calibration
coordinates by a Lagrangian over all components: each takes the step that minimises
``weight * distortion + lam * rate``, ``lam`` set so the mean rate (the tables' entropy) meets the
budget; components whose best choice is "not sent" get width 0. Rates are therefore fractional.

Payloads ("ans-1") are the codes of every sent component, component-major, ANS-coded with
``constriction`` against the space's tables (nothing per payload); the widths also fit the
fixed-rate bit planes ("planes-2"), the fast path, at ``sum(w_j)`` bits per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

STEP_GRID = tuple(round(0.08 * 1.15 ** i, 4) for i in range(30))  # steps in units of the component's sigma
MIN_WIDTH, MAX_WIDTH = 2, 8
CLAMPED = 1e-4  # the largest share of calibration indices a container width may clamp
FLOOR = 1e-3  # share of each table spread evenly over its codes: every code stays codable (unseen: ~10 + w bits)
PACKING = "ans-1"


class EcsqError(ValueError):
    """Entropy-coded words that do not decode to a whole payload against the space's tables."""


@dataclass(slots=True)
class EcsqQuantiser:
    """Per component: step (0: not sent), container width, and a probability table over its codes."""

    steps: torch.Tensor  # [n] float32, absolute (the basis coordinate's units)
    widths: torch.Tensor  # [n] int64, 0 or MIN_WIDTH..MAX_WIDTH
    probabilities: torch.Tensor  # [sum(2^widths of sent components)] float32, each component's table in turn
    _models: list | None = field(default=None, init=False, repr=False)
    _least: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name, dtypes in (("steps", (torch.float32,)), ("widths", (torch.int64, torch.int32, torch.uint8)),
                             ("probabilities", (torch.float32,))):
            tensor = getattr(self, name)
            if tensor.dtype not in dtypes or tensor.dim() != 1:
                raise ValueError(f"ECSQ {name} must be a flat tensor of {dtypes}, got {tensor.dtype} "
                                 f"{tuple(tensor.shape)}")
        self.widths = self.widths.to(torch.int64)
        sent = self.widths > 0
        if self.steps.shape != self.widths.shape:
            raise ValueError("ECSQ steps and widths must have one entry per component")
        if bool(((self.widths != 0) & ((self.widths < MIN_WIDTH) | (self.widths > MAX_WIDTH))).any()):
            raise ValueError(f"ECSQ widths must be 0 or {MIN_WIDTH}..{MAX_WIDTH}")
        if not bool(torch.isfinite(self.steps).all()) or bool((self.steps[sent] <= 0).any()) \
                or bool((self.steps[~sent] != 0).any()):
            raise ValueError("ECSQ steps must be finite, positive for sent components and 0 for the others")
        expected = int((1 << self.widths[sent]).sum())
        if self.probabilities.numel() != expected:
            raise ValueError(f"ECSQ tables hold {self.probabilities.numel()} probabilities, the widths need {expected}")
        if not bool(torch.isfinite(self.probabilities).all()) or bool((self.probabilities <= 0).any()):
            raise ValueError("ECSQ probabilities must be finite and positive")

    @property
    def sent(self) -> torch.Tensor:
        return self.widths > 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"ecsq_steps": self.steps, "ecsq_widths": self.widths, "ecsq_probabilities": self.probabilities}

    def tables(self) -> list[torch.Tensor]:
        """Each sent component's normalised table, in component order."""
        sizes = (1 << self.widths[self.sent]).tolist()
        return [t / t.sum() for t in torch.split(self.probabilities.double(), sizes)]

    def mean_rate(self) -> float:
        """The tables' entropy in bits per component (over every component, sent or not): what a
        range-coded payload spends per element on text like the calibration's."""
        bits = sum(float(-(t * torch.log2(t)).sum()) for t in self.tables())
        return bits / self.widths.numel()

    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        """Codes ``[T, n]`` (uint8; 0 for components not sent) of coordinates ``z`` ``[T, n]``."""
        w = self.widths.to(z.device)
        centre = torch.where(w > 0, 1 << (w - 1).clamp_min(0), 0).to(z.dtype)
        step = self.steps.to(z)
        q = torch.round(z / torch.where(step > 0, step, torch.ones_like(step))) + centre
        q = torch.minimum(q.clamp_min(0), ((1 << w) - 1).to(z.dtype))
        return torch.where(w > 0, q, torch.zeros_like(q)).to(torch.uint8)

    def dequantize(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Reconstruction ``(code - 2^(w - 1)) * step`` (0 where a component is not sent)."""
        w = self.widths.to(codes.device)
        centre = torch.where(w > 0, 1 << (w - 1).clamp_min(0), 0).to(dtype)
        return (codes.to(dtype) - centre) * self.steps.to(device=codes.device, dtype=dtype)

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
        Raises :class:`EcsqError` unless the words decode to exactly that many codes with that digest
        (damaged words decode to other codes, or stop short, or leave words over: all refused)."""
        import constriction

        if words.dtype != torch.int32 or words.dim() != 1:
            raise EcsqError("entropy-coded words must be a flat int32 tensor")
        if 32 * words.numel() + 64 < 0.99 * self.least_bits(tokens):  # before a chunk's worth of decoding
            raise EcsqError(f"{words.numel()} entropy-coded words cannot hold {tokens} tokens of codes")
        models = self._coder_models()
        out = np.empty((len(models), tokens), dtype=np.uint8)
        try:
            coder = constriction.stream.stack.AnsCoder(words.cpu().numpy().view(np.uint32).copy())
            for i, model in enumerate(models):
                out[i] = coder.decode(model, tokens)
            if not coder.is_empty():
                raise EcsqError("entropy-coded words hold more than the payload's codes")
        except (ValueError, RuntimeError, AssertionError, OverflowError) as exc:
            if isinstance(exc, EcsqError):
                raise
            raise EcsqError(f"entropy-coded words do not decode: {exc}") from None
        if codes_digest(out) != digest:
            raise EcsqError("entropy-coded words decode to other codes than were written")
        return torch.from_numpy(out)


def codes_digest(codes: np.ndarray) -> str:
    """xxh3-64 of component-major uint8 codes: a range-coded payload carries it for its decoded codes."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(codes, dtype=np.uint8).tobytes())


def step_tables(z: torch.Tensor, sigma: torch.Tensor, chunk: int = 256
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each component and step of :data:`STEP_GRID` (with "not sent" first): the in-sample rate (the
    clamped codes' bits under their floored table, as the coder spends them), the MSE, and the container
    width (inf rate where even 8 bits would clamp more than :data:`CLAMPED` of the indices). ``z`` ``[T, n]``:
    centred coordinates."""
    n = z.shape[1]
    k = len(STEP_GRID) + 1
    rate, mse = torch.full((n, k), math.inf), torch.zeros(n, k)
    width = torch.zeros(n, k, dtype=torch.int64)
    rate[:, 0] = 0
    mse[:, 0] = z.pow(2).mean(0)
    for lo in range(0, n, chunk):
        cols = slice(lo, min(n, lo + chunk))
        zc, s = z[:, cols].float(), sigma[cols].float().clamp_min(1e-12)
        m = zc.shape[1]
        for g, grid_step in enumerate(STEP_GRID, start=1):
            delta = s * grid_step
            index = torch.round(zc / delta)
            spread = index.abs().quantile(1 - CLAMPED, dim=0) if index.shape[0] > 1 else index.abs()[0]
            need = torch.clamp(torch.ceil(torch.log2(2 * spread + 2)), min=MIN_WIDTH).to(torch.int64)
            ok = need <= MAX_WIDTH
            w = need.clamp_max(MAX_WIDTH)
            half = (1 << (w - 1)).float()
            q = torch.minimum((index + half).clamp_min(0), (2 * half - 1)).to(torch.int64)  # codes 0..2^w - 1
            err = (zc - (q.float() - half) * delta).pow(2).mean(0)
            size = 1 << MAX_WIDTH
            counts = torch.bincount((torch.arange(m) * size + q).flatten(), minlength=m * size).view(m, size).double()
            p = counts / counts.sum(1, keepdim=True)
            table = p * (1 - FLOOR) + FLOOR / (1 << w).double().unsqueeze(1)  # what the coder will use
            coded = -(p * torch.log2(table.clamp_min(1e-300))).sum(1).float()  # 2^w..256 codes: p = 0 there
            rate[cols, g] = torch.where(ok, coded, torch.full_like(coded, math.inf))
            mse[cols, g], width[cols, g] = err, w
    return rate, mse, width


def allocate(rate: torch.Tensor, mse: torch.Tensor, weights: torch.Tensor, budget_bits: float, iters: int = 80
             ) -> torch.Tensor:
    """Each component's choice (column of :func:`step_tables`) minimising ``w * mse + lam * rate``, with
    ``lam`` the smallest whose mean rate is at most ``budget_bits`` per component."""
    cost_rate = torch.where(torch.isfinite(rate), rate, torch.full_like(rate, 1e9))

    def choice(lam: float) -> torch.Tensor:
        return (weights.unsqueeze(1) * mse + lam * cost_rate).argmin(1)

    rows = torch.arange(rate.shape[0])
    lo, hi = 1e-9, 1e9
    best = choice(hi)
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        picked = choice(mid)
        if float(cost_rate[rows, picked].mean()) <= budget_bits:
            hi, best = mid, picked
        else:
            lo = mid
    return best


def fit(z: torch.Tensor, sigma: torch.Tensor, weights: torch.Tensor, budget_bits: float) -> EcsqQuantiser:
    """The :class:`EcsqQuantiser` of calibration coordinates ``z`` ``[T, n]`` at ``budget_bits`` coded bits
    per component on average (``weights``: each component's distortion weight)."""
    rate, mse, width = step_tables(z, sigma)
    picked = allocate(rate, mse, weights.float(), budget_bits)
    rows = torch.arange(z.shape[1])
    grid = torch.tensor((0.0, *STEP_GRID))
    steps = torch.where(picked > 0, grid[picked] * sigma.float(), torch.zeros(())).float()
    widths = torch.where(picked > 0, width[rows, picked], torch.zeros((), dtype=torch.int64))
    probe = EcsqQuantiser(steps, widths, torch.ones(int((1 << widths[widths > 0]).sum())))
    codes = probe.quantize(z.float())
    tables = []
    for j in widths.nonzero().flatten().tolist():
        counts = torch.bincount(codes[:, j].to(torch.int64), minlength=1 << int(widths[j])).double()
        tables.append((counts / counts.sum() * (1 - FLOOR) + FLOOR / counts.numel()).float())
    probabilities = torch.cat(tables).float() if tables else torch.zeros(0)
    return EcsqQuantiser(steps, widths, probabilities)
