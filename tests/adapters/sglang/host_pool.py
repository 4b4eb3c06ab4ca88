"""A stand-in for SGLang 0.5.23's MHA host pool (``pool_host/mha.py``, ``MHATokenToKVPoolHost``), and its
quantised variants: the real classes do not import on this CPU (their package pulls in torchvision through
``sglang.srt.configs``) and need a device pool's pointer tables to build. The stand-in keeps what a storage
backend touches, with SGLang's shapes and dtype rule: the host pool's ``dtype`` is the device pool's
``store_dtype``, which is ``torch.uint8`` for ``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``
(``MHATokenToKVPool.__init__``), ``torch.float8_e4m3fn`` for ``mxfp8`` (``MHATokenToKVPoolMXFP8``, whose host
pool also keeps ``k_scale_host`` / ``v_scale_host``) and the kv dtype itself otherwise (``nvfp4``:
``torch.float4_e2m1fn_x2``; MiniMax's NVFP4 host pool: ``torch.uint8``)."""

from __future__ import annotations

import torch

from tests.bundles import LAYOUT

PAGE = 8
L, H, D = LAYOUT.num_layers, LAYOUT.kv_heads, LAYOUT.head_dim
FP8_STORED_AS_UINT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)


def store_dtype(kv_dtype: torch.dtype, mxfp8: bool = False) -> torch.dtype:
    """The dtype SGLang's device pool (and so its host pool) stores a ``kv_dtype`` KV cache in."""
    if mxfp8:
        return torch.float8_e4m3fn
    return torch.uint8 if kv_dtype in FP8_STORED_AS_UINT8 else kv_dtype


class HostPool:
    """``kv_buffer`` ``[2, layers, tokens, heads, dim]`` (layer_first) or ``[2, tokens, layers, heads, dim]``
    (page_first) and the page accessors, as SGLang's MHA host pool has them."""

    def __init__(self, layout: str = "layer_first", tokens: int = 64, dtype: torch.dtype = torch.float16) -> None:
        self.layout, self.page_size, self.dtype = layout, PAGE, dtype
        self.layer_num, self.head_num, self.head_dim = L, H, D
        dims = (2, L, tokens, H, D) if layout == "layer_first" else (2, tokens, L, H, D)
        self.kv_buffer = (torch.zeros(dims, dtype=dtype) if dtype.itemsize > 1
                          else torch.zeros(dims, dtype=torch.uint8).view(dtype))  # fp8 / fp4: as raw bytes
        self.writes: list[int] = []  # host indices written, in order

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = (self.kv_buffer[:, :, index:index + PAGE] if self.layout == "layer_first"
                else self.kv_buffer[:, index:index + PAGE])
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.writes.append(index)
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + PAGE] = data_page.reshape(2, L, PAGE, H, D)
        else:
            self.kv_buffer[:, index:index + PAGE] = data_page.reshape(2, PAGE, L, H, D)


class MXFP8HostPool(HostPool):
    """``MHATokenToKVPoolMXFP8Host``: fp8 payload (page_first only) plus per-block UE8M0 scales."""

    def __init__(self, tokens: int = 64) -> None:
        super().__init__("page_first", tokens, torch.float8_e4m3fn)
        self.k_scale_host = torch.zeros(tokens // PAGE, H, D // 4, dtype=torch.uint8)
        self.v_scale_host = torch.zeros(tokens // PAGE, H, D // 4, dtype=torch.uint8)
