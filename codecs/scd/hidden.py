"""The PATCH part of a code space: codes of the producer's normalised pre-attention input ``H_in``
at the patch layers, in a calibrated basis per layer (the same transform coding as the KV groups).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from scd_store.codecs.scd.quantizer import allocate_bits, dequantize, quantize


@dataclass(slots=True)
class HiddenCode:
    """Per patch layer: a mean, an orthonormal basis (by decreasing variance), component standard
    deviations and bits for ``H_in`` rows of width ``D`` (the model's hidden size)."""

    layers: tuple[int, ...]
    mean: torch.Tensor  # [P, D]
    basis: torch.Tensor  # [P, D, D]
    sigma: torch.Tensor  # [P, D]
    bits: torch.Tensor  # [P, D]

    def __post_init__(self) -> None:
        if any(isinstance(layer, bool) for layer in self.layers):
            raise ValueError(f"patch layers must be integers, got {self.layers}")
        self.layers = tuple(operator.index(layer) for layer in self.layers)  # no float / string coercion
        p = len(self.layers)
        if p == 0 or len(set(self.layers)) != p or min(self.layers) < 0:
            raise ValueError(f"patch layers must be distinct non-negative indices, got {self.layers}")
        d = self.mean.shape[-1]
        for name, shape in (("mean", (p, d)), ("basis", (p, d, d)), ("sigma", (p, d)), ("bits", (p, d))):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"hidden code {name} has shape {tuple(getattr(self, name).shape)}, expected {shape}")
        if int(self.bits.min()) < 0 or int(self.bits.max()) > 8:
            raise ValueError("bits per component must be within 0..8")
        self.bits = self.bits.to(torch.int64)

    @classmethod
    def from_statistics(cls, layers: tuple[int, ...], mean: torch.Tensor, cov: torch.Tensor, bits_per_dim: float
                        ) -> HiddenCode:
        """PCA basis per layer and ``bits_per_dim`` on average spread over the components."""
        eigvals, eigvecs = torch.linalg.eigh(cov.double())
        eigvals, eigvecs = eigvals.flip(-1).clamp_min(0), eigvecs.flip(-1)
        bits = allocate_bits(eigvals, torch.ones_like(eigvals), round(bits_per_dim * eigvals.numel()))
        return cls(layers, mean.float(), eigvecs.float(), eigvals.sqrt().float(), bits)

    @property
    def width(self) -> int:
        return self.mean.shape[-1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"hidden_mean": self.mean, "hidden_basis": self.basis, "hidden_sigma": self.sigma,
                "hidden_bits": self.bits}

    def quantize(self, hidden: dict[int, torch.Tensor], sinks: int) -> torch.Tensor:
        """Codes ``[T - sinks, P * D]`` of the rows of ``hidden`` (layer -> ``[T, D]``) past the sinks."""
        missing = [layer for layer in self.layers if layer not in hidden]
        if missing:
            raise ValueError(f"the code space patches layers {list(self.layers)}: capture H_in at {missing}")
        x = torch.stack([hidden[layer][sinks:].float() for layer in self.layers])  # [P, T, D]
        z = torch.bmm(x - self.mean.to(x).unsqueeze(1), self.basis.to(x)).transpose(0, 1).reshape(x.shape[1], -1)
        flat_bits = self.bits.flatten().to(z.device)
        return quantize(z, self.sigma.flatten().to(z), flat_bits)

    def reconstruct(self, codes: torch.Tensor) -> torch.Tensor:
        """Decoded ``H_in`` ``[T, P, D]`` from codes ``[T, P * D]``."""
        flat_bits = self.bits.flatten().to(codes.device)
        zhat = dequantize(codes, self.sigma.flatten().to(codes.device), flat_bits)
        zhat = zhat.view(codes.shape[0], len(self.layers), self.width).transpose(0, 1)  # [P, T, D]
        basis = self.basis.to(zhat)
        return (torch.bmm(zhat, basis.transpose(1, 2)) + self.mean.to(zhat).unsqueeze(1)).transpose(0, 1)
