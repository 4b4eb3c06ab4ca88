"""The registry's records: a code space generation (one producer, one encoder bundle) and a pair.

A space is named by its id and, per bundle generation, its fingerprint: two generations of one
space (a rollout) are two records (``ident``: ``{space_id}@{generation}``) and their blobs live
under different keys (:func:`scd_store.store.keys.generation_of`). A pair names the generation of
the space its decoder was calibrated on.
"""

from __future__ import annotations

from dataclasses import dataclass

from scd_store.errors import ScdStoreError
from scd_store.store.keys import generation_of, scope_of, validate_space_id


class RegistryError(ScdStoreError, ValueError):
    """A registry problem (conflicting registration, unreadable registry)."""


class NotRegistered(RegistryError):  # noqa: N818 - the name the issue uses
    """A pair or space that the registry does not know (or no longer: revoked), or a consumer not
    registered for it."""


class NotAuthorized(RegistryError):  # noqa: N818
    """A model tried to write into a space it does not produce."""


def _non_empty(owner: str, record: object, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(record, name), str) or not getattr(record, name):
            raise RegistryError(f"{owner}: {name} must be a non-empty string")


@dataclass(frozen=True, slots=True)
class Space:
    """One generation of a code space: its producer model and its encoder bundle's fingerprint."""

    space_id: str
    producer_model_id: str
    producer_fingerprint: str
    bundle_fingerprint: str
    codec_id: str = ""
    chunk_size: int = 256
    raw_kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        validate_space_id(self.space_id)
        _non_empty(f"space {self.space_id!r}", self, ("producer_model_id", "producer_fingerprint",
                                                      "bundle_fingerprint"))
        if not isinstance(self.codec_id, str):
            raise RegistryError(f"space {self.space_id!r}: codec_id must be a string")
        for name, least in (("chunk_size", 1), ("raw_kv_bytes_per_token", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise RegistryError(f"space {self.space_id!r}: {name} must be an integer >= {least}, got {value!r}")

    @property
    def fingerprint(self) -> str:
        """What every blob of this space carries as its space fingerprint."""
        return self.bundle_fingerprint

    @property
    def generation(self) -> str:
        """The key generation of this space's blobs (format version + fingerprint hash)."""
        return generation_of(self.bundle_fingerprint)

    @property
    def ident(self) -> str:
        """The registry's name of this record: ``{space_id}@{generation}``."""
        return f"{self.space_id}@{self.generation}"

    @property
    def scope(self) -> str:
        """Where shared tiers keep the keys readers report in this generation: ``{space_id}:{generation}``."""
        return scope_of(self.space_id, self.generation)


@dataclass(frozen=True, slots=True)
class Pair:
    """A consumer model registered against one generation of a space, with its decoder bundle."""

    pair_id: str
    space_id: str
    consumer_model_id: str
    consumer_fingerprint: str
    bundle_fingerprint: str
    space_fingerprint: str

    def __post_init__(self) -> None:
        validate_space_id(self.space_id)
        _non_empty(f"pair {self.pair_id!r}", self, ("pair_id", "consumer_model_id", "consumer_fingerprint",
                                                    "bundle_fingerprint", "space_fingerprint"))

    @property
    def generation(self) -> str:
        """The key generation of the space generation this pair decodes."""
        return generation_of(self.space_fingerprint)

    @property
    def ident(self) -> str:
        """The registry's name of this record: ``{pair_id}@{generation}``."""
        return f"{self.pair_id}@{self.generation}"
