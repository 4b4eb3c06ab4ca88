"""The fault soak's rogue consumer: a consumer process (its own least-privilege Redis user, public keys only)
that attacks the deployment the whole run, as a compromised consumer or a tenant of one would.

Each round it tries one attack, and counts attempts and what got through (which must be nothing):

- ``claim_producer``: asks the store for the producer's write face and puts its own bytes (the store-level
  form of a tenant tagging its request with the producer's name): with no private key nothing is stored;
- ``sign_own``: signs blobs with a key it made under the real key id (and with the public key's bytes as
  a seed) and writes them to Redis (refused by its ACL) and into the consumers' shared disk tier;
- ``plant_files``: replaces blob files of the shared disk tier with symlinks to ``/dev/zero`` and FIFOs;
- ``expire``: ``PEXPIRE key 0``, ``EXPIRE``, ``DEL``, ``SET`` on genuine blob keys (refused by its ACL);
- ``forge_reports``: reports genuine blobs of its generation, blobs of another generation and keys that are
  not there as bad (so their producer would delete or rewrite them), and every blob and other spaces' keys as
  hits (so their TTLs would be refreshed for ever);
- ``flood``: writes 1 MiB hashes and strings under the counters' and other prefixes (refused by its ACL: it may
  write no key) and publishes 1 MiB reports (delivered, refused, stored nowhere), to make Redis evict blobs.

The harness then checks that consumers served no garbage and that every blob the rogue reported is still
there and genuine.
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path
from typing import Any

ATTACKS = ("claim_producer", "sign_own", "plant_files", "expire", "forge_reports", "flood")
FLOOD_BYTES = 1 << 20


class Rogue:
    """One rogue consumer process's attacks (``spec`` as the soak's workers get it, plus ``raw_url``)."""

    def __init__(self, spec: dict[str, Any], store: Any, keys_of: Any, rng: random.Random) -> None:
        import redis

        from scd_store.store.tiers.disk import DiskTier

        self.spec, self.store, self.keys_of, self.rng = spec, store, keys_of, rng
        self.client = redis.Redis.from_url(spec["url"], socket_timeout=1.0)
        self.disk = DiskTier(spec["disk"], 1 << 30, rescan_s=None) if spec.get("disk") else None
        self.counts = {name: {"attempts": 0, "got_through": 0} for name in ATTACKS}
        self.reported: set[str] = set()
        self.absent: set[str] = set()

    def round(self) -> None:
        attack = ATTACKS[self.rng.randrange(len(ATTACKS))]
        self.counts[attack]["attempts"] += 1
        with contextlib.suppress(Exception):  # a refused or failed attack got nothing through
            self.counts[attack]["got_through"] += getattr(self, attack)()

    def _keys(self) -> list[str]:
        return self.keys_of(self.rng.randrange(self.spec["prefixes"]))

    def claim_producer(self) -> int:
        from scd_store.bench.fault_space import CHUNK, FINGERPRINT, PRODUCER, SPACE
        from scd_store.store.keys import chunk_hashes

        hashes = chunk_hashes([9_000_000 + self.rng.randrange(10**6) for _ in range(CHUNK)], CHUNK)
        view = self.store.producer(SPACE, PRODUCER, FINGERPRINT)  # the registry authorises by name only
        return len(view.put(hashes, [b"the consumer's own kv"], [CHUNK], codec_id="raw"))

    def _forgeries(self, key: str) -> list[bytes]:
        from scd_store.bench.fault_space import CHUNK, FINGERPRINT
        from scd_store.store.blob import BlobMeta, encode_blob
        from scd_store.store.signing import SigningKey, VerifyKey, parse_key_file

        public = parse_key_file(Path(self.spec["keyring"]).read_text(), "keyring")[0]
        assert isinstance(public, VerifyKey), "a consumer holds public keys only"
        own = SigningKey.generate(public.key_id, spaces=public.spaces)  # the real key id, a key of its own
        seeded = SigningKey(public.key_id, public.public, spaces=public.spaces)  # all it knows of the producer's key
        meta = BlobMeta("raw", FINGERPRINT, CHUNK)
        return [encode_blob(meta, b"rogue kv" * 64, key=key, signer=signer) for signer in (own, seeded)]

    def sign_own(self) -> int:
        key = self._keys()[0]
        got = 0
        for blob in self._forgeries(key):
            with contextlib.suppress(Exception):  # its ACL refuses SET on blob keys
                got += bool(self.client.set(key, blob, keepttl=True))
            if self.disk is not None:
                self._replace(self.disk.path_for(key), blob)
        return got

    def _replace(self, path: Path, blob: bytes | None, *, link: str | None = None, fifo: bool = False) -> None:
        """Put a planted entry at ``path`` atomically (a file, a symlink or a FIFO)."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".rogue-{os.getpid()}-{self.rng.randrange(10**9)}")
        if link is not None:
            os.symlink(link, tmp)
        elif fifo:
            os.mkfifo(tmp, 0o600)
        else:
            tmp.write_bytes(blob or b"")
        os.replace(tmp, path)

    def plant_files(self) -> int:
        if self.disk is None:
            return 0
        key = self._keys()[-1]
        if self.rng.random() < 0.5:
            self._replace(self.disk.path_for(key), None, link="/dev/zero")
        else:
            self._replace(self.disk.path_for(key), None, fifo=True)
        return 0  # what counts is that readers never hang, never decode it (the consumers' garbage count)

    def expire(self) -> int:
        key = self._keys()[0]
        got = 0
        for command in (("PEXPIRE", key, 0), ("EXPIRE", key, 0), ("PEXPIRE", key, -1), ("DEL", key),
                        ("SET", key, b"x"), ("PERSIST", key)):
            with contextlib.suppress(Exception):  # NOPERM for a consumer user
                self.client.execute_command(*command)
                got += 1
        return got

    def _publish(self, scope: str, kind: str, keys: list[str]) -> None:
        from scd_store.store.tiers.redis_reports import channel_of, report_messages

        for message in report_messages(kind, keys):
            self.client.publish(channel_of(scope), message)

    def forge_reports(self) -> int:
        from scd_store.bench.fault_space import FINGERPRINT, OTHER_FINGERPRINT, SPACE, other_generation_keys
        from scd_store.store.keys import generation_of

        genuine = self._keys()
        foreign = other_generation_keys()[:4]
        absent = self.keys_of(self.spec["prefixes"] + self.rng.randrange(1000))  # never written: nothing to rewrite
        scope = f"{SPACE}:{generation_of(FINGERPRINT)}"
        self._publish(scope, "suspects", [*genuine, *foreign, *absent])
        self._publish(f"{SPACE}:{generation_of(OTHER_FINGERPRINT)}", "suspects", genuine)  # under the other's scope
        everything = [k for i in range(self.spec["prefixes"]) for k in self.keys_of(i)]
        self._publish(scope, "hits", [*everything, "scd:other:v3.0123456789abcdef:" + "0" * 32])
        self.reported.update(genuine + foreign)
        self.absent.update(absent)
        return 0  # the harness checks the reported blobs are still there and genuine, the absent ones still absent

    def flood(self) -> int:
        """Writes that would fill the instance (each refused: got through counts the ones that were not)."""
        from scd_store.bench.fault_space import FINGERPRINT, SPACE
        from scd_store.store.keys import generation_of

        n = self.rng.randrange(10**9)
        got = 0
        for command in (("HSET", f"scd:__stats__:flood:{n}", "f", b"x" * FLOOD_BYTES),
                        ("SET", f"scd:__stats__:flood:{n}", b"x" * FLOOD_BYTES),
                        ("HSET", "scd:__stats__", f"flood{n}", b"x" * FLOOD_BYTES),
                        ("LPUSH", f"scd:{SPACE}:flood", b"x" * FLOOD_BYTES)):
            with contextlib.suppress(Exception):  # NOPERM: a consumer writes no key at all
                self.client.execute_command(*command)
                got += 1
        self.client.publish(f"scd:__reports__:{SPACE}:{generation_of(FINGERPRINT)}", b"x" * FLOOD_BYTES)
        return got

    def report(self) -> dict[str, Any]:
        return {"attacks": self.counts, "reported_keys": sorted(self.reported),
                "reported_absent": sorted(self.absent)[:4096]}

    def close(self) -> None:
        self.client.close()
