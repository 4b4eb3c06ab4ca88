"""The consumer side of SCD: per-group affine maps from a space's codes to the consumer's KV.

Trainable form (what calibration distils, per group ``g``)::

    x_hat = mean + z_hat @ basis^T          # the producer's feature, reconstructed
    y     = x_hat + x_hat @ W + b           # the consumer's feature (W = 0, b = mean shift at init)

Folded for decoding: ``y = z_hat @ M + c`` with ``M = basis^T (I + W)`` and
``c = mean (I + W) + b``, and the quantiser's steps and offsets folded in too, so the integer codes
go through one small matmul per layer and tensor, batched over tokens and groups.

Two structures of ``W``: ``dense`` ``[G, C, C]`` (every KV head of a layer mixes into every other) and
``per-head`` ``[G, H, D, D]`` (block-diagonal, one map per KV head), which keeps a decoder within 2% of
its consumer's weights on geometries with many KV heads (a multi-head-attention 7B: 68 MB instead of
2.1 GB). :func:`choose_structure` picks dense where it fits. Distilled maps are kept in bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from scd_store.codecs.fingerprint import tensors_fingerprint
from scd_store.codecs.scd.patch import PatchAligner
from scd_store.codecs.scd.quantizer import STEP, code_centres_of
from scd_store.codecs.scd.space import CodeSpace


@dataclass(slots=True)
class PairDecoder:
    """One consumer's decoder for one code space."""

    consumer: str
    space_fingerprint: str
    weight: torch.Tensor  # [G, C, C] dense or [G, H, D, D] per KV head; residual: y = x + x @ W + b
    bias: torch.Tensor  # [G, C]
    consumer_fingerprint: str = ""
    patches: list[PatchAligner] = field(default_factory=list)  # PATCH layers, applied after the maps

    def __post_init__(self) -> None:
        g, c = self.bias.shape
        shape = tuple(self.weight.shape)
        per_head = len(shape) == 4 and shape[0] == g and shape[2] == shape[3] and shape[1] * shape[2] == c
        if shape != (g, c, c) and not per_head:
            raise ValueError(f"decoder weight {shape} does not match bias {tuple(self.bias.shape)}: expected "
                             f"[{g}, {c}, {c}] (dense) or [{g}, heads, head_dim, head_dim] (per-head)")
        layers = [p.layer for p in self.patches]
        if len(set(layers)) != len(layers) or any(not 0 <= layer < g // 2 for layer in layers):
            raise ValueError(f"patch layers {layers} must be distinct layers of the model")
        if any(p.k_proj.shape[0] != c for p in self.patches):
            raise ValueError("patch aligners do not produce this decoder's feature width")

    @property
    def structure(self) -> str:
        """``"dense"`` or ``"per-head"``."""
        return "dense" if self.weight.dim() == 3 else "per-head"

    @classmethod
    def identity(cls, space: CodeSpace, consumer: str, mean_shift: torch.Tensor | None = None) -> PairDecoder:
        """The decoder that returns the producer's KV (plus an optional mean shift)."""
        g, c = space.layout.groups, space.layout.width
        bias = torch.zeros(g, c) if mean_shift is None else mean_shift.float().clone()
        return cls(consumer, space.fingerprint, torch.zeros(g, c, c), bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, named as stored in a bundle (``patch.<layer>.<name>`` for aligners)."""
        tensors = {"weight": self.weight, "bias": self.bias}
        for patch in self.patches:
            tensors.update({f"patch.{patch.layer}.{k}": v for k, v in patch.tensors().items()})
        return tensors

    @property
    def fingerprint(self) -> str:
        sources = ",".join(f"{p.layer}:{p.source}" for p in self.patches)
        return tensors_fingerprint(self.tensors(), extra=self.space_fingerprint + (f"|{sources}" if sources else ""))

    def folded(self, space: CodeSpace, device: torch.device | str, dtype: torch.dtype, *, centred: bool = False,
               with_map: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``(M, c)`` with ``y = q M + c`` straight from the integer codes ``q`` (as floats): the basis,
        the map and each component's quantiser step and offset folded together. Zero-bit
        components contribute nothing. Not cached here: :class:`ScdCodec` keeps the cut, contiguous copy.

        ``centred=True`` folds for the signed codes ``s = q - 2^(b - 1)`` instead (:func:`centred_codes`):
        ``y = s M + c``, the quantiser's offset a mere half step, so a low-precision product (bf16 holds
        every such ``s`` exactly) does not cancel a large ``q M`` against a large ``c``.

        ``with_map=False`` folds the space alone (``y`` = the producer's reconstructed features, the same for
        every consumer): a per-head map is then applied after the product (:func:`apply_map`), so no
        ``[G, components, C]`` matrix per consumer is ever built."""
        if space.fingerprint != self.space_fingerprint:
            raise ValueError(f"decoder for {self.consumer} was calibrated for space {self.space_fingerprint}, "
                             f"not {space.fingerprint}")
        matrix = space.basis.double().transpose(1, 2)  # z_hat -> x_hat
        offset = space.mean.double()
        if with_map:  # x_hat -> y = x_hat + x_hat W + b
            weight = self.weight.double()
            matrix = matrix + apply_map(matrix.transpose(0, 1), weight).transpose(0, 1)
            offset = offset + apply_map(offset, weight) + self.bias.double()
        # fixed rate (mid-rise): z_hat_j = (q_j - levels_j / 2 + 0.5) * step_j, and 0 where a component has no bits;
        # ECSQ (mid-tread): z_hat_j = (q_j - levels_j / 2) * step_j
        if space.ecsq is not None:
            step, half = space.ecsq.steps.double().view_as(space.sigma), 0.0
        else:
            step, half = torch.tensor(STEP, dtype=torch.float64)[space.bits] * space.sigma.double(), 0.5
        # z_hat_j = (s_j + half) * step_j with s_j = q_j - 2^(b_j - 1) (centred) or q_j - centre_j
        sent = (space.bits > 0).double()
        centre = -half * sent if centred else code_centres(space).double() - half * sent
        matrix = matrix * step.unsqueeze(-1)
        offset = offset - torch.bmm(centre.unsqueeze(1), matrix).squeeze(1)
        return matrix.to(device=device, dtype=dtype), offset.to(device=device, dtype=dtype)


def apply_map(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x W`` for features ``x`` ``[..., G, C]`` (any strides; differentiable: what distillation trains
    through) and a dense ``[G, C, C]`` or per-head ``[G, H, D, D]`` map."""
    if weight.dim() == 3:
        return torch.einsum("...gc,gcd->...gd", x, weight)
    heads, dim = weight.shape[1], weight.shape[2]
    per_head = x.reshape(*x.shape[:-1], heads, dim)
    return torch.einsum("...ghc,ghcd->...ghd", per_head, weight).reshape(x.shape)


STRUCTURES = ("auto", "dense", "per-head")
SIZE_LIMIT = 0.02  # a decoder's bytes against its consumer's own weight bytes
MAP_DTYPE = torch.bfloat16  # how a distilled map is kept (its entries are small corrections: 2^-9 relative is plenty)


def map_shape(groups: int, kv_heads: int, head_dim: int, structure: str) -> tuple[int, ...]:
    """The shape of a ``structure`` map: ``[G, C, C]`` dense, ``[G, H, D, D]`` per-head."""
    width = kv_heads * head_dim
    return (groups, width, width) if structure == "dense" else (groups, kv_heads, head_dim, head_dim)


def decoder_bytes(groups: int, kv_heads: int, head_dim: int, structure: str) -> int:
    """Bytes of a decoder's map (bf16) and bias (fp32) for a geometry (PATCH aligners not counted)."""
    matrix = math.prod(map_shape(groups, kv_heads, head_dim, structure))
    return MAP_DTYPE.itemsize * matrix + 4 * groups * kv_heads * head_dim


def choose_structure(groups: int, kv_heads: int, head_dim: int, consumer_bytes: int, requested: str = "auto") -> str:
    """``requested`` unless ``"auto"``: then dense when it stays within :data:`SIZE_LIMIT` of ``consumer_bytes``,
    else per-head."""
    if requested not in STRUCTURES:
        raise ValueError(f"decoder structure must be one of {STRUCTURES}, got {requested!r}")
    if requested != "auto":
        return requested
    dense = decoder_bytes(groups, kv_heads, head_dim, "dense")
    return "dense" if dense <= SIZE_LIMIT * consumer_bytes else "per-head"


def code_centres(space: CodeSpace) -> torch.Tensor:
    """``2^(b - 1)`` per component ``[G, C]`` (int64; 0 without bits): the code of a quantiser's middle."""
    return code_centres_of(space.bits)


def centred_codes(codes: torch.Tensor, centres: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``s = q - 2^(b - 1)`` of uint8 codes ``q`` into ``out`` (any float dtype): integers in
    ``[-128, 127]``, exact in bf16; zero for components without bits (their ``q`` and centre are 0).
    ``centres`` (uint8, :func:`code_centres`) broadcasts against ``codes``, which are overwritten: the
    subtraction wraps in uint8 and is read back as int8, so it costs one byte pass and one conversion."""
    torch.sub(codes, centres, out=codes)
    return out.copy_(codes.view(torch.int8))
