"""A rotated scalar quantiser in the TurboQuant / PolarQuant style, as a baseline at a few bits.

Each head vector (keys as the engine stores them, values) is multiplied by a random-sign Hadamard
matrix, which spreads its energy evenly, so every rotated coordinate of a unit vector is close to
``N(0, 1 / head_dim)``; its norm is kept in fp16, and each normalised coordinate (scaled to unit
variance) gets the Lloyd-Max quantiser of a unit Gaussian at ``bits`` bits. Bytes: ``bits`` per
element plus 16 bits per vector (a head_dim that is not a power of two is zero-padded to one, and
the padding's codes are paid for too). No calibration and no consumer adaptation.
"""

from __future__ import annotations

import math

import torch

from scd_store.codecs.base import Codec, kv_shape
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.tensor_pack import PayloadError, pack, unpack

# Lloyd-Max reconstruction levels of a unit Gaussian (Max 1960), positive half, by bit count
LLOYD_MAX = {
    1: (0.7979,),
    2: (0.4528, 1.5104),
    3: (0.2451, 0.7560, 1.3439, 2.1520),
    4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326),
}
SIGN_SEED = 0x5CD  # the rotation's random signs: fixed, so every process rotates alike


def levels(bits: int) -> torch.Tensor:
    """All ``2^bits`` reconstruction levels, ascending."""
    half = torch.tensor(LLOYD_MAX[bits])
    return torch.cat([-half.flip(0), half])


def padded(dim: int) -> int:
    """The power of two a head vector of ``dim`` numbers is rotated at."""
    return 1 << max(0, dim - 1).bit_length()


def rotation(dim: int) -> torch.Tensor:
    """The orthonormal ``[dim, dim]`` rotation ``H diag(signs) / sqrt(dim)`` (``dim`` a power of two)."""
    if dim & (dim - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (dim,), generator=torch.Generator().manual_seed(SIGN_SEED)) * 2 - 1
    return h * signs.float() / math.sqrt(dim)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (uint8 < 2^bits, flat) as ``bits`` bit planes of ``ceil(n / 8)`` bytes each."""
    n = codes.numel()
    planes = []
    for b in range(bits):
        plane = ((codes.flatten() >> b) & 1).to(torch.uint8)
        plane = torch.cat([plane, plane.new_zeros((-n) % 8)]).view(-1, 8)
        planes.append((plane << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8))
    return torch.cat(planes)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Invert :func:`pack_bits`: ``n`` codes (uint8)."""
    per_plane = -(-n // 8)
    if packed.numel() != bits * per_plane:
        raise PayloadError(f"packed codes hold {packed.numel()} bytes, expected {bits * per_plane}")
    planes = packed.view(bits, per_plane, 1) >> torch.arange(8, dtype=torch.uint8, device=packed.device)
    planes = (planes & 1).view(bits, -1)[:, :n]
    weights = (1 << torch.arange(bits, dtype=torch.uint8, device=packed.device)).view(bits, 1)
    return (planes * weights).sum(0, dtype=torch.uint8)


class RotatedCodec(Codec):
    """Random-sign Hadamard rotation, an fp16 norm per head vector, Lloyd-Max codes at ``bits`` bits."""

    def __init__(self, bits: int):
        if bits not in LLOYD_MAX:
            raise ValueError(f"the rotated quantiser supports {sorted(LLOYD_MAX)} bits, not {bits}")
        self.bits = bits
        self.codec_id = f"rot{bits}"

    def _encode_tensor(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = padded(x.shape[-1])
        x = torch.nn.functional.pad(x.float(), (0, d - x.shape[-1]))
        rotated = x @ rotation(d).to(x.device).T
        norm = rotated.norm(dim=-1, keepdim=True)
        unit = rotated / norm.clamp_min(1e-12) * math.sqrt(d)  # coordinates ~ N(0, 1)
        lv = levels(self.bits).to(x.device)
        thresholds = (lv[1:] + lv[:-1]) / 2
        codes = torch.bucketize(unit.contiguous(), thresholds).to(torch.uint8)
        return pack_bits(codes, self.bits), norm.squeeze(-1).half()

    def _decode_tensor(self, packed: torch.Tensor, norm: torch.Tensor, shape: list[int], device) -> torch.Tensor:
        d = padded(shape[-1])
        codes = unpack_bits(packed.to(device), self.bits, math.prod(shape[:-1]) * d).view(*shape[:-1], d)
        if list(norm.shape) != shape[:-1]:
            raise PayloadError(f"norms of shape {tuple(norm.shape)} do not fit KV of shape {shape}")
        unit = levels(self.bits).to(device)[codes.long()]
        rotated = unit * (norm.to(device).float().unsqueeze(-1) / math.sqrt(d))
        return (rotated @ rotation(d).to(device))[..., :shape[-1]]

    def encode(self, state: KVState) -> bytes:
        k_codes, k_norm = self._encode_tensor(state.keys)
        v_codes, v_norm = self._encode_tensor(state.values)
        meta = {"shape": list(state.keys.shape), "bits": self.bits}
        return pack(self.codec_id, meta, {"k_codes": k_codes, "k_norm": k_norm, "v_codes": v_codes, "v_norm": v_norm})

    def decode(self, payload: bytes | torch.Tensor, *, device="cpu", dtype=torch.float32,
               expect_tokens: int | None = None) -> KVState:
        _, meta, t = unpack(payload, self.codec_id)
        try:
            shape = kv_shape(meta, self.codec_id, expect_tokens, self.bits)  # before unpacking: that allocates
            keys = self._decode_tensor(t["k_codes"], t["k_norm"], shape, device)
            values = self._decode_tensor(t["v_codes"], t["v_norm"], shape, device)
        except (KeyError, IndexError, ValueError, RuntimeError, TypeError) as exc:
            if isinstance(exc, PayloadError):
                raise
            raise PayloadError(f"{self.codec_id} payload is inconsistent: {exc}") from None
        return KVState(keys.to(dtype=dtype), values.to(dtype=dtype))
