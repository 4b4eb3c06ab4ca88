"""What each engine model name is to scd-store: a space's producer, one of its consumers, or nothing.

:class:`Binding` is one model's role, space and codec (typed against the codec interface,
:class:`scd_store.codecs.base.Codec`); :class:`Bindings` holds a process's bindings by model name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from scd_store.codecs.base import Codec
from scd_store.codecs.scd.space import CodeSpace
from scd_store.errors import ScdStoreError
from scd_store.service.defaults import MAX_POSITIONS


class Role(str, Enum):
    """What a model is to a space: the one model that writes its codes, or one that reads them."""

    PRODUCER = "producer"
    CONSUMER = "consumer"

    __str__ = str.__str__  # "producer" in text and logs, as enum.StrEnum (Python 3.11+) would print it
    __format__ = str.__format__


class ServiceError(ScdStoreError, ValueError):
    """A bad service configuration (unreadable bundle, a model bound twice)."""


@dataclass(frozen=True, slots=True)
class Binding:
    """One engine model name bound to a space: as its producer, or as a consumer through ``pair_id``."""

    model: str
    role: Role  # given as a Role or its value
    space: CodeSpace
    codec: Codec  # the space's encoder; for a consumer, its decoder too
    pair_id: str = ""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise ServiceError(f"role must be one of {[r.value for r in Role]}, got {self.role!r}") from None
        if (self.role is Role.CONSUMER) != bool(self.pair_id):
            raise ServiceError(f"a consumer binding needs a pair id and a producer none ({self.model!r})")


def pair_id_for(space_id: str, consumer: str) -> str:
    """The registry's pair id of ``consumer`` in ``space_id``."""
    return f"{space_id}/{consumer}"


class Bindings:
    """Engine model names to bindings; ``aliases`` maps an engine's name (a served-model name, a
    checkpoint path) to the name the bundle knows the model by. A model is bound at most once. Every
    bound space refuses payloads reaching past ``max_positions`` (the engine's context length) before
    anything is allocated for them."""

    def __init__(self, aliases: Mapping[str, str] | None = None, max_positions: int = MAX_POSITIONS) -> None:
        if max_positions <= 0:
            raise ServiceError(f"max_positions must be positive, got {max_positions}")
        self.aliases = dict(aliases or {})
        self.max_positions = max_positions
        self._by_model: dict[str, Binding] = {}

    def add(self, binding: Binding) -> None:
        other = self._by_model.get(binding.model)
        if other is not None:
            raise ServiceError(f"model {binding.model!r} is bound twice: as {other.role} of space "
                               f"{other.space.space_id!r} and as {binding.role} of {binding.space.space_id!r}")
        binding.space.max_positions = self.max_positions
        self._by_model[binding.model] = binding

    def get(self, model: str) -> Binding | None:
        """The binding of an engine model name (after aliases), or None for a model scd-store does not serve."""
        return self._by_model.get(self.aliases.get(model, model))

    def space(self, fingerprint: str) -> CodeSpace | None:
        """A code space a binding already holds, by fingerprint (a model bound later shares it)."""
        return next((b.space for b in list(self._by_model.values()) if b.space.fingerprint == fingerprint), None)

    def roles(self) -> dict[str, str]:
        """Every bound model name and its role."""
        return {name: b.role.value for name, b in sorted(self._by_model.items())}
