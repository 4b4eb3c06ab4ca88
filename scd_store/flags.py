"""One rule for true / false wherever a setting arrives as text (YAML, engine configs, environment)."""

from __future__ import annotations

from typing import Any

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def parse_flag(value: Any, name: str = "flag") -> bool:
    """``True`` / ``False`` as given, the integers ``1`` / ``0`` (YAML's ``fsync: 1``), or one of
    :data:`TRUE` / :data:`FALSE` in any case; anything else is a ``ValueError`` naming ``name`` (never a
    guess: ``"flase"`` is not false, ``2`` is not true)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return value == 1
    if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
        return value.strip().lower() in TRUE
    raise ValueError(f"{name} must be true or false ({'/'.join(TRUE)} or {'/'.join(FALSE)}), got {value!r}")
