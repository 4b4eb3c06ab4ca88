"""Entropy-coded scalar quantisers (ECSQ) over a code space's basis, and their range-coded payload.

Each component ``j`` gets a uniform mid-tread quantiser of step ``steps[j]`` (index
``round(z / step)``, a zero bin, reconstruction at ``index * step``) whose indices are stored as
codes ``index + 2^(w_j - 1)`` of container width ``w_j`` (2..8 bits; indices past it are clamped),
and a probability table over those ``2^w_j`` codes. Steps are chosen on the calibration
coordinates by a Lagrangian over all components: each takes the step that minimises
``weight * distortion + lam * rate``, ``lam`` set so the mean rate (the tables' entropy) meets the
budget; components whose best choice is "not sent" get width 0. Rates are therefore fractional.

Payloads ("ans-1", :mod:`~scd_store.codecs.scd.range_coding`) are range-coded against those tables;
the widths also fit the fixed-rate bit planes ("planes-2"), the fast path, at ``sum(w_j)`` bits per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from scd_store.codecs.scd.quantizer import code_centres_of
from scd_store.codecs.scd.range_coding import CodeTables, count_tables, floored

STEP_GRID = tuple(round(0.08 * 1.15 ** i, 4) for i in range(30))  # steps in units of the component's sigma
MIN_WIDTH, MAX_WIDTH = 2, 8
CLAMPED = 1e-4  # the largest share of calibration indices a container width may clamp


@dataclass(slots=True)
class EcsqQuantiser:
    """Per component: step (0: not sent), container width, and a probability table over its codes
    (:class:`~scd_store.codecs.scd.range_coding.CodeTables`, which range-codes them)."""

    steps: torch.Tensor  # [n] float32, absolute (the basis coordinate's units)
    widths: torch.Tensor  # [n] int64, 0 or MIN_WIDTH..MAX_WIDTH
    probabilities: torch.Tensor  # [sum(2^widths of sent components)] float32, each component's table in turn
    coder: CodeTables = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.steps.dtype != torch.float32 or self.steps.dim() != 1:
            raise ValueError(f"ECSQ steps must be a flat float32 tensor, got {self.steps.dtype} "
                             f"{tuple(self.steps.shape)}")
        self.coder = CodeTables(self.widths, self.probabilities)  # checks widths and probabilities
        self.widths = self.coder.widths
        sent = self.widths > 0
        if self.steps.shape != self.widths.shape:
            raise ValueError("ECSQ steps and widths must have one entry per component")
        if bool(((self.widths != 0) & (self.widths < MIN_WIDTH)).any()):
            raise ValueError(f"ECSQ widths must be 0 or {MIN_WIDTH}..{MAX_WIDTH}")
        if not bool(torch.isfinite(self.steps).all()) or bool((self.steps[sent] <= 0).any()) \
                or bool((self.steps[~sent] != 0).any()):
            raise ValueError("ECSQ steps must be finite, positive for sent components and 0 for the others")

    @property
    def sent(self) -> torch.Tensor:
        return self.widths > 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"ecsq_steps": self.steps, "ecsq_widths": self.widths, "ecsq_probabilities": self.probabilities}

    def mean_rate(self) -> float:
        """The tables' entropy in bits per component (sent or not): :meth:`CodeTables.mean_rate`."""
        return self.coder.mean_rate()

    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        """Codes ``[T, n]`` (uint8; 0 for components not sent) of coordinates ``z`` ``[T, n]``."""
        w = self.widths.to(z.device)
        centre = code_centres_of(w).to(z.dtype)
        step = self.steps.to(z)
        q = torch.round(z / torch.where(step > 0, step, torch.ones_like(step))) + centre
        q = torch.minimum(q.clamp_min(0), ((1 << w) - 1).to(z.dtype))
        return torch.where(w > 0, q, torch.zeros_like(q)).to(torch.uint8)

    def dequantize(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Reconstruction ``(code - 2^(w - 1)) * step`` (0 where a component is not sent)."""
        centre = code_centres_of(self.widths.to(codes.device)).to(dtype)
        return (codes.to(dtype) - centre) * self.steps.to(device=codes.device, dtype=dtype)


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
            table = floored(p, (1 << w).double().unsqueeze(1))  # what the coder will use
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


def fit(z: torch.Tensor, sigma: torch.Tensor, weights: torch.Tensor, budget_bits: float,
        tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> EcsqQuantiser:
    """The :class:`EcsqQuantiser` of calibration coordinates ``z`` ``[T, n]`` at ``budget_bits`` coded bits
    per component on average (``weights``: each component's distortion weight). ``tables``:
    :func:`step_tables` of the same ``z`` and ``sigma``, when already made (they do not depend on the budget)."""
    rate, mse, width = tables if tables is not None else step_tables(z, sigma)
    picked = allocate(rate, mse, weights.float(), budget_bits)
    rows = torch.arange(z.shape[1])
    grid = torch.tensor((0.0, *STEP_GRID))
    steps = torch.where(picked > 0, grid[picked] * sigma.float(), torch.zeros(())).float()
    widths = torch.where(picked > 0, width[rows, picked], torch.zeros((), dtype=torch.int64))
    codes = EcsqQuantiser(steps, widths, torch.ones(int((1 << widths[widths > 0]).sum()))).quantize(z.float())
    return EcsqQuantiser(steps, widths, count_tables(codes, widths))
