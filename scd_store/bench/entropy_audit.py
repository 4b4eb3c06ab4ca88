"""What a code space's indices would cost entropy-coded: measured rates, before a coder is built.

Every rate here is a *cross-entropy*: symbol tables are counted on one set of tokens (the space's
calibration text) and the bits are those an ideal arithmetic coder with those tables would spend on
other tokens (held-out text). Tables would live in the space, so nothing per payload is counted.
Rates are bits per coded element (one basis coordinate of one token).

- :func:`coded_bits`: order-0 (a table per component), or conditioned on a context per element
  (the same component's previous token, or the previous layer's same component), coarsened to at
  most ``CONTEXT_BITS`` bits so the tables stay learnable.
- :func:`ecsq_tables`: entropy-coded uniform scalar quantisers (a zero bin, any step, no clamp to a
  bit width) per component over a grid of steps; :func:`ecsq_allocate` picks each component's step
  by a Lagrangian so the weighted distortion matches a target: the fractional-rate alternative to
  integer bit widths.
- :func:`gaussian_rate`: reverse water-filling over eigenvalues, for a joint basis over layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CONTEXT_BITS = 3  # a context is the conditioning index's top bits: at most 8 tables per component
SMOOTHING = 0.5  # add-half (Krichevsky-Trofimov) counts: an unseen symbol still has a finite cost
ESCAPE = 4096  # ECSQ indices are clamped to +-ESCAPE (beyond it: never seen at any step of the grid)
STEP_GRID = tuple(round(0.05 * 1.15 ** i, 4) for i in range(36))  # steps in units of the component's sigma


def coarsen(codes: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Contexts from codes ``[T, n]`` of ``bits[j]``-bit components: their top ``CONTEXT_BITS`` bits."""
    shift = (bits - CONTEXT_BITS).clamp_min(0).to(codes.device)
    return (codes.to(torch.int64) >> shift).to(torch.int64)


def coded_bits(train: torch.Tensor, test: torch.Tensor, alphabet: torch.Tensor,
               train_context: torch.Tensor | None = None, test_context: torch.Tensor | None = None,
               contexts: int = 1) -> torch.Tensor:
    """Bits per component ``[n]`` that ``test`` ``[T', n]`` (int symbols in ``0..alphabet[j]-1``) costs
    with per-component (per-context) tables counted on ``train`` ``[T, n]``, mean over ``test`` rows."""
    n = train.shape[1]
    size = int(alphabet.max())
    cells = n * contexts * size
    if cells > 200_000_000:
        raise ValueError(f"{cells} table cells: too many components, contexts or symbols at once")
    comp = torch.arange(n, dtype=torch.int64)

    def flat(symbols: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        ctx = context if context is not None else torch.zeros_like(symbols, dtype=torch.int64)
        return (comp * contexts + ctx) * size + symbols.to(torch.int64)

    counts = torch.bincount(flat(train, train_context).flatten(), minlength=cells).double().view(n, contexts, size)
    valid = torch.arange(size).unsqueeze(0) < alphabet.unsqueeze(1)  # [n, size]
    counts = (counts + SMOOTHING) * valid.unsqueeze(1)
    probs = counts / counts.sum(-1, keepdim=True)
    cost = -torch.log2(probs.clamp_min(1e-300)).flatten()
    return cost[flat(test, test_context)].mean(0).float()


def entropy_bits(codes: torch.Tensor, alphabet: torch.Tensor) -> torch.Tensor:
    """In-sample order-0 entropy per component ``[n]`` (bits): the optimistic bound of :func:`coded_bits`."""
    n, size = codes.shape[1], int(alphabet.max())
    counts = torch.bincount((torch.arange(n) * size + codes.to(torch.int64)).flatten(), minlength=n * size)
    p = counts.double().view(n, size) / codes.shape[0]
    return -(p * torch.log2(p.clamp_min(1e-300))).sum(-1).float()


@dataclass(frozen=True, slots=True)
class EcsqTables:
    """Per component and step of :data:`STEP_GRID`: held-out rate (bits) and held-out MSE (in the
    component's own units), with the zero-rate option (not sent: decoded as the mean) first."""

    steps: torch.Tensor  # [S + 1] in sigma units; 0 = not sent
    rate: torch.Tensor  # [n, S + 1]
    mse: torch.Tensor  # [n, S + 1]
    train_rate: torch.Tensor  # [n, S + 1]: what the allocation sees (counted on the table's own tokens)
    train_mse: torch.Tensor  # [n, S + 1]


def ecsq_tables(train: torch.Tensor, test: torch.Tensor, sigma: torch.Tensor, chunk: int = 256) -> EcsqTables:
    """:class:`EcsqTables` of basis coordinates ``train`` / ``test`` ``[T, n]`` (centred) for components of
    standard deviation ``sigma`` ``[n]``: uniform mid-tread quantisers (index ``round(z / step)``,
    reconstruction at the index's mean on ``train``), entropy coded with tables from ``train``."""
    n = train.shape[1]
    grid = torch.tensor(STEP_GRID, dtype=torch.float32)
    rate = torch.zeros(n, len(grid) + 1)
    mse = torch.zeros(n, len(grid) + 1)
    train_rate = torch.zeros(n, len(grid) + 1)
    train_mse = torch.zeros(n, len(grid) + 1)
    mse[:, 0] = test.pow(2).mean(0)
    train_mse[:, 0] = train.pow(2).mean(0)
    for lo in range(0, n, chunk):
        cols = slice(lo, min(n, lo + chunk))
        z_train, z_test, s = train[:, cols], test[:, cols], sigma[cols].clamp_min(1e-12)
        width = z_train.shape[1]
        for k, step in enumerate(grid.tolist(), start=1):
            delta = s * step
            q_train = (z_train / delta).round().clamp(-ESCAPE, ESCAPE).to(torch.int64) + ESCAPE
            q_test = (z_test / delta).round().clamp(-ESCAPE, ESCAPE).to(torch.int64) + ESCAPE
            lo_sym = int(min(q_train.min(), q_test.min()))
            q_train, q_test = q_train - lo_sym, q_test - lo_sym
            size = int(max(q_train.max(), q_test.max())) + 1
            alphabet = torch.full((width,), size, dtype=torch.int64)
            rate[cols, k] = coded_bits(q_train, q_test, alphabet)
            train_rate[cols, k] = coded_bits(q_train, q_train, alphabet)
            # reconstruction: each index's mean on train (a centroid table, as a real coder would keep)
            comp = torch.arange(width, dtype=torch.int64) * size
            sums = torch.bincount((comp + q_train).flatten(), weights=z_train.flatten().double(),
                                  minlength=width * size)
            counts = torch.bincount((comp + q_train).flatten(), minlength=width * size).double()
            centre = ((q_train.new_tensor(range(size)) + lo_sym - ESCAPE).double().unsqueeze(0) * delta.double()
                      .unsqueeze(1)).flatten()
            centroid = torch.where(counts > 0, sums / counts.clamp_min(1), centre).float()
            train_mse[cols, k] = (z_train - centroid[comp + q_train]).pow(2).mean(0)
            mse[cols, k] = (z_test - centroid[comp + q_test]).pow(2).mean(0)
    return EcsqTables(torch.cat([torch.zeros(1), grid]), rate, mse, train_rate, train_mse)


def ecsq_choice(tables: EcsqTables, weights: torch.Tensor, lam: float) -> torch.Tensor:
    """Each component's step index minimising ``w * mse + lam * rate`` on the tables' own tokens."""
    cost = weights.unsqueeze(1) * tables.train_mse + lam * tables.train_rate
    return cost.argmin(1)


def ecsq_allocate(tables: EcsqTables, weights: torch.Tensor, target: float, iters: int = 60
                  ) -> tuple[torch.Tensor, float, float]:
    """Step indices ``[n]`` whose held-out weighted distortion ``sum w * mse`` is at most ``target`` at the
    lowest rate the Lagrangian finds; returns (choice, held-out mean rate, held-out weighted distortion)."""
    rows = torch.arange(weights.numel())

    def measure(lam: float) -> tuple[torch.Tensor, float, float]:
        choice = ecsq_choice(tables, weights, lam)
        return (choice, float(tables.rate[rows, choice].mean()),
                float((weights * tables.mse[rows, choice]).sum()))

    lo, hi = 1e-12, 1e6  # lam: distortion grows with it
    best = measure(lo)
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        result = measure(mid)
        if result[2] <= target:
            lo, best = mid, result
        else:
            hi = mid
    return best


def ecsq_at_rate(tables: EcsqTables, weights: torch.Tensor, rate: float, iters: int = 60
                 ) -> tuple[torch.Tensor, float, float]:
    """As :func:`ecsq_allocate`, for the lowest distortion whose held-out mean rate is at most ``rate``."""
    rows = torch.arange(weights.numel())
    lo, hi = 1e-12, 1e6
    best = None
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        choice = ecsq_choice(tables, weights, mid)
        r = float(tables.rate[rows, choice].mean())
        if r <= rate:
            hi, best = mid, (choice, r, float((weights * tables.mse[rows, choice]).sum()))
        else:
            lo = mid
    if best is None:
        raise ValueError(f"no allocation reaches {rate} bits per element")
    return best


def gaussian_rate(eigenvalues: torch.Tensor, distortion: float) -> float:
    """Bits (total) reverse water-filling spends on components of ``eigenvalues`` for a total MSE of
    ``distortion``: the Gaussian rate-distortion function at that point."""
    lam = eigenvalues.double().clamp_min(0)
    if distortion >= float(lam.sum()):
        return 0.0
    lo, hi = 0.0, float(lam.max())
    for _ in range(200):
        theta = (lo + hi) / 2
        if float(torch.minimum(lam, torch.tensor(theta, dtype=lam.dtype)).sum()) > distortion:
            hi = theta
        else:
            lo = theta
    theta = lo
    return float((0.5 * torch.log2(lam / theta)).clamp_min(0).sum()) if theta > 0 else float("inf")
