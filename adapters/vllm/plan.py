"""What the scheduler side tells the worker side each step (:class:`StepPlan`): chunks to load, chunks to store.

Both travel inside vLLM's :class:`KVConnectorMetadata` from the scheduler to the model runner
(vLLM's own transport between its processes). A token's slot is ``block_id * block_size +
offset`` from the request's block table; a chunk's position is its index in the request's prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


def slots_of(block_ids: list[int], block_size: int, first: int, last: int) -> list[int]:
    """Slots of the request's tokens ``first .. last - 1``."""
    if last > len(block_ids) * block_size:
        raise ValueError(f"tokens up to {last} need more than the request's {len(block_ids)} blocks")
    return [block_ids[t // block_size] * block_size + t % block_size for t in range(first, last)]


@dataclass(slots=True)
class ChunkLoad:
    """A consumer request's hit: decode ``hashes`` (chunks ``0 .. n-1`` of its prompt) and write their
    tokens ``first_token ..`` (those the engine has not computed itself) into the request's blocks;
    ``asynchronous``: between steps, on the fetch thread (chunks only a remote tier holds)."""

    req_id: str
    model: str
    hashes: list[bytes]
    chunk_size: int
    first_token: int
    block_ids: list[int]
    block_size: int
    asynchronous: bool = False

    def __post_init__(self) -> None:
        end = len(self.hashes) * self.chunk_size
        if not 0 <= self.first_token < end or end > len(self.block_ids) * self.block_size:
            raise ValueError(f"a load of tokens {self.first_token}..{end} into {len(self.block_ids)} blocks of "
                             f"{self.block_size}")

    @property
    def slots(self) -> list[int]:
        """Slots of the tokens to write, ``first_token ..`` the hit's end."""
        return slots_of(self.block_ids, self.block_size, self.first_token, len(self.hashes) * self.chunk_size)

    def blocks_from(self, token: int) -> set[int]:
        """Blocks holding the loaded tokens from ``token`` on (reported as failed when they cannot be loaded)."""
        end = len(self.hashes) * self.chunk_size
        first = max(token, self.first_token) // self.block_size
        return set(self.block_ids[first:(end + self.block_size - 1) // self.block_size])


@dataclass(slots=True)
class ChunkSave:
    """A producer request's newly computed whole chunks: ``hashes[i]`` starts at token ``starts[i]``,
    whose tokens lie at ``slots[i]``. ``refill``: chunks vLLM's own prefix cache held that the store
    had lost (stored again, counted as ``refilled_chunks``)."""

    req_id: str
    model: str
    hashes: list[bytes]
    starts: list[int]
    slots: list[list[int]]
    refill: bool = False

    def __post_init__(self) -> None:
        if not len(self.hashes) == len(self.starts) == len(self.slots):
            raise ValueError("a save needs one start and one slot list per chunk hash")


@dataclass
class StepPlan(KVConnectorMetadata):
    """One step's loads and saves, the consumer lookups since the last step (``(model, tokens)``,
    counted where the loads happen so that process's hit rate is its own), ``cancelled``: requests
    that finished (aborted) while their asynchronous load was in flight (the worker stops it, and still
    reports it finished once), and ``released``: finished producer requests whose blocks were held for a
    refill check, released once this step's saves have copied their blocks (the worker reports each
    once, as ``finished_sending``, and vLLM frees the blocks)."""

    loads: list[ChunkLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    lookups: list[tuple[str, int]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
