"""``scd-store keys new`` and ``scd-store keys public``: Ed25519 key pairs for signed codes.

A producer signs with the private file; every reader verifies with the public one (it cannot sign).
Every key is made for one space (``--space``), whose blobs alone it signs and verifies, or, asked for
explicitly, for every space (``--all-spaces``, with a warning). Key files hold
``key_id ed25519-private:HEX spaces=...`` / ``key_id ed25519-public:HEX spaces=...`` lines
(:mod:`scd_store.store.signing`); a directory of ``<space_id>.keys`` files (+ ``default.keys``) is read by
:mod:`scd_store.store.keyring`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ALL_SPACES_WARNING = ("scd-store keys new: warning: --all-spaces makes one key for every space: the producer "
                      "holding it can sign codes of every space, and every reader accepts them. Prefer one key per "
                      "space (--space SPACE).")


def _target(path: Path, space: str | None) -> Path:
    """``path`` itself, or ``path/<space or default>.keys`` when it is a directory (made 0700 when missing and a
    space is named)."""
    from scd_store.store.fs_safety import private_dir

    if space is not None and (path.is_dir() or not path.exists()) and not path.suffix:
        return private_dir(path, "the key directory") / f"{space}.keys"
    return path / "default.keys" if path.is_dir() else path


def new_command(args: argparse.Namespace) -> int:
    from scd_store.store.keys import KeyError_, validate_space_id
    from scd_store.store.signing import ALL_SPACES, KeyringError, SigningKey, parse_until, write_key_file

    if (args.space is None) == (not args.all_spaces):
        print("scd-store keys new: name the space the key is for (--space SPACE), or ask for a key of every space "
              "(--all-spaces)", file=sys.stderr)
        return 2
    try:
        if args.space is not None:
            validate_space_id(args.space)
        else:
            print(ALL_SPACES_WARNING, file=sys.stderr)
        until = parse_until(args.until, "--until") if args.until else None
        key = SigningKey.generate(args.key_id, spaces=(args.space,) if args.space else (ALL_SPACES,), until=until)
        private, public = _target(args.private, args.space), _target(args.public, args.space)
        if private.resolve() == public.resolve():
            raise KeyringError("--private and --public must be different files: readers get only the public one")
        write_key_file(private, [key.line()], private=True, append=args.append)
        assert key.public is not None
        write_key_file(public, [key.public.line()], private=False, append=args.append)
    except (KeyringError, KeyError_, OSError, ValueError) as exc:
        print(f"scd-store keys new: {exc}", file=sys.stderr)
        return 2
    scope = f"space {args.space}" if args.space else "every space"
    print(f"key {key.key_id} for {scope}: private {private} (give it to the space's producers only), public {public} "
          "(every reader); set signing_keys to the file or its directory")
    return 0


def public_command(args: argparse.Namespace) -> int:
    from scd_store.store.signing import KeyringError, SigningKey, parse_key_file

    try:
        keys = parse_key_file(args.private.read_text(), str(args.private))
    except (KeyringError, OSError) as exc:
        print(f"scd-store keys public: {exc}", file=sys.stderr)
        return 2
    for key in keys:
        public = key.public if isinstance(key, SigningKey) else key
        assert public is not None
        print(public.line())
    return 0


def add_keys_parsers(sub: Any) -> None:
    keys = sub.add_parser("keys", help="signing keys: producers sign codes, readers verify").add_subparsers(
        dest="keys", required=True)
    new = keys.add_parser("new", help="make an Ed25519 key pair for one space (a private file for its producers, a "
                          "public one for readers)")
    new.add_argument("--key-id", required=True, help="the id blobs carry (1-64 of [A-Za-z0-9._-])")
    new.add_argument("--private", type=Path, required=True, help="private key file, or a directory for <space>.keys")
    new.add_argument("--public", type=Path, required=True, help="public key file, or a directory for <space>.keys")
    scope = new.add_mutually_exclusive_group()
    scope.add_argument("--space", help="the space the key signs and verifies (a directory, made when missing, gets "
                       "it in its <space>.keys; a file gets a line naming the space)")
    scope.add_argument("--all-spaces", action="store_true", help="a key for every space (spaces=*): its producer can "
                       "sign any space's codes; only where one producer serves them all")
    new.add_argument("--until", help="end of validity (unix seconds or ISO-8601 UTC)")
    new.add_argument("--append", action="store_true", help="add the key to existing files (rotation: it verifies at "
                     "once; move its private line first on producers to sign with it)")
    new.set_defaults(func=new_command)
    public = keys.add_parser("public", help="print the public lines of a private key file")
    public.add_argument("private", type=Path)
    public.set_defaults(func=public_command)
