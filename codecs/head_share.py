"""A tensor-parallel rank's share of a model's KV heads: :class:`HeadShare`.

Codes cover every KV head of the model (one code space, one payload per chunk, whatever the consumer's
tensor-parallel size). A rank's cache holds ``count`` of the ``total`` heads from ``first`` on; it decodes
the payload and keeps its share. vLLM's rule (``Attention``'s ``num_kv_heads // tp_size``, replicated
when there are more ranks than heads): with ``size`` ranks and ``total`` heads, rank ``r`` holds
heads ``r * total // size ..`` (``total // size`` of them) when ``total >= size``, else the one head
``r // (size // total)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scd_store.codecs.kv_state import KVState


@dataclass(frozen=True, slots=True)
class HeadShare:
    """Heads ``first .. first + count`` of ``total``."""

    first: int
    count: int
    total: int

    def __post_init__(self) -> None:
        if self.total < 1 or self.count < 1 or self.first < 0 or self.first + self.count > self.total:
            raise ValueError(f"heads {self.first}..{self.first + self.count} of {self.total} are not a share")

    @classmethod
    def of_rank(cls, rank: int, size: int, total: int) -> HeadShare:
        """Rank ``rank`` of ``size`` tensor-parallel ranks' heads of ``total`` KV heads, as vLLM shards them."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of a tensor-parallel group of {size}")
        if total >= size:
            if total % size:
                raise ValueError(f"{total} KV heads do not split over {size} tensor-parallel ranks")
            per = total // size
            return cls(rank * per, per, total)
        if size % total:
            raise ValueError(f"{size} tensor-parallel ranks do not replicate {total} KV heads evenly")
        return cls(rank // (size // total), 1, total)

    @property
    def is_whole(self) -> bool:
        return self.count == self.total

    def select(self, kv: torch.Tensor) -> torch.Tensor:
        """The share of ``[layers, total heads, tokens, head_dim]`` KV (a view)."""
        if kv.dim() != 4 or kv.shape[1] != self.total:
            raise ValueError(f"KV of shape {tuple(kv.shape)} does not hold {self.total} heads on axis 1")
        return kv.narrow(1, self.first, self.count)

    def narrow(self, state: KVState) -> KVState:
        """``state`` with this share's heads only (views)."""
        return KVState(self.select(state.keys), self.select(state.values), start=state.start)
