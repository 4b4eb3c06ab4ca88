"""A user's own text for calibration or evaluation: .txt / .md files, folders of them, and JSONL.

JSONL lines carry either a ``text`` string or chat ``messages`` (``[{"role": ..., "content": ...}]``,
rendered later with the model's own chat template). A :class:`UserText` has no splits: the user
holds text out by passing other files to ``bench quality --text`` than to ``calibrate --text``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from scd_store.errors import ScdStoreError

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)


class TextError(ScdStoreError, ValueError):
    """User text that cannot be read: a missing path, an empty file, a malformed JSONL line."""


@dataclass(frozen=True, slots=True)
class TextDocument:
    """One document: plain ``text``, or chat ``messages`` to render with a tokenizer's chat template."""

    name: str
    text: str = ""
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)

    def render(self, tokenizer) -> str:
        """The document as the model reads it (chat messages through ``tokenizer``'s template)."""
        if not self.messages:
            return self.text
        if getattr(tokenizer, "chat_template", None) is None:
            raise TextError(f"{self.name}: chat messages need a tokenizer with a chat template")
        return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in self.messages], tokenize=False)


def _jsonl(path: Path) -> list[TextDocument]:
    docs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise TextError(f"{where}: not JSON ({exc})") from None
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            if record["text"].strip():
                docs.append(TextDocument(where, text=record["text"]))
            continue
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise TextError(f"{where}: expected an object with a 'text' string or 'messages' "
                            "[{'role': str, 'content': str}, ...]")
        docs.append(TextDocument(where, messages=tuple((m["role"], m["content"]) for m in messages)))
    return docs


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (*TEXT_SUFFIXES, *JSONL_SUFFIXES))
        if not found:
            raise TextError(f"{path}: no {', '.join((*TEXT_SUFFIXES, *JSONL_SUFFIXES))} files in this folder")
        return found
    if not path.is_file():
        raise TextError(f"{path}: no such file or folder")
    if path.suffix not in (*TEXT_SUFFIXES, *JSONL_SUFFIXES):
        raise TextError(f"{path}: expected .txt, .md or .jsonl, or a folder of them")
    return [path]


def read_documents(paths: tuple[str, ...]) -> list[TextDocument]:
    """Every document under ``paths`` in a stable order; raises :class:`TextError` naming the problem."""
    docs: list[TextDocument] = []
    for raw in paths:
        for path in _files(Path(raw).expanduser()):
            if path.suffix in JSONL_SUFFIXES:
                found = _jsonl(path)
            else:
                text = path.read_text(encoding="utf-8", errors="replace")
                found = [TextDocument(str(path), text=text)] if text.strip() else []
            if not found:
                raise TextError(f"{path}: empty (no text in it)")
            docs.extend(found)
    return docs


@dataclass(frozen=True, slots=True)
class UserText:
    """Text files a user brings (see :func:`read_documents`); read once, on first use."""

    paths: tuple[str, ...]
    _docs: list = field(default_factory=list, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if not self.paths:
            raise TextError("no text paths given")

    @property
    def name(self) -> str:
        """How reports name this text."""
        return "text:" + ",".join(self.paths)

    def documents(self) -> list[TextDocument]:
        if not self._docs:
            self._docs.extend(read_documents(self.paths))
        return self._docs
