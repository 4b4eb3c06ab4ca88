"""``scd-store bench soak``: one producer and ``processes`` consumer processes on one Redis while faults hit.

Each process (:mod:`scd_store.bench.fault_worker`) is its own OS process with its own least-privilege
Redis user (:mod:`scd_store.store.redis_acl`, loaded from an ACL file so a restart keeps them), a small
CPU tier (so reads go to lower tiers) and a disk tier: the producer its own, the consumers one they share
(as the processes of one host do). The producer signs with the private key, the consumers hold the
public one. The registry is written once by the operator user; Redis runs with an append-only file, so
it survives the kills. A rogue consumer (:mod:`scd_store.bench.fault_rogue`: its own consumer user and
public keys) attacks all run long: it claims the producer's role, signs blobs with keys of its own, plants
symlinks and FIFOs in the consumers' disk tier, tries ``PEXPIRE key 0`` and friends, forges reports (genuine
blobs of this generation and of the next one and keys never written reported bad, every blob reported as a
hit) and floods the instance (1 MiB hashes and strings, which its user may not write, and 1 MiB published
reports). Redis runs with ``maxmemory`` and the recipe's server settings (``volatile-lru``, eviction events,
the clients' memory capped), so a flood that got in would evict blobs, and the producer counts what is
evicted. Faults, at fixed fractions of ``duration_s``:

- blob waves (0.15, 0.35, 0.55): blobs in Redis corrupted (one flipped byte), forged (well formed,
  signed with another key) and moved (a genuine blob under another chunk's key);
- Redis SIGKILLed and restarted ``outage_s`` later (0.25, 0.45);
- the producer's disk filled (0.60) and freed (0.70): a tmpfs mounted for the run (needs root;
  otherwise reported in ``not_injected``);
- the pair revoked (0.80): every consumer must refuse within ``registry_refresh_s`` plus a read.

The report counts what was injected, what the processes detected (their counters), what became of
each injected blob (repaired, gone, still there), requests completed and failed, garbage decodes
(chunks served whose bytes are not their key's payload: must be 0), what the rogue got through (must
be nothing), whether every blob it reported is still there and genuine (and every key it reported that was never written
still absent), and whether every put the producer acknowledged is in Redis at the end or counted as lost or
evicted.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scd_store.bench.fault_space import (
    CHUNK,
    CONSUMER,
    FINGERPRINT,
    OTHER_FINGERPRINT,
    PAIR,
    PRODUCER,
    SPACE,
    other_generation_keys,
    payload_for,
)
from scd_store.store.redis_acl import SERVER_SETTINGS, acl_setuser

KINDS = ("corrupted", "forged", "moved")


@dataclass(frozen=True, slots=True)
class FaultSoakConfig:
    processes: int = 3  # consumer processes (plus one producer)
    duration_s: float = 60.0
    prefixes: int = 96
    chunks: int = 4
    payload_bytes: int = 8 << 10
    per_wave: int = 4  # blobs of each kind per wave
    outage_s: float = 2.0
    registry_refresh_s: float = 0.5
    ttl_s: float = 3600.0
    maxmemory: int = 64 << 20  # the blobs' instance: room for the run's blobs, not for a flood
    seed: int = 0

    def __post_init__(self) -> None:
        if self.processes < 1 or self.duration_s < 10 or self.prefixes < 4 or self.per_wave < 1:
            raise ValueError("need >= 1 consumer process, >= 10 s, >= 4 prefixes and >= 1 blob per wave")


class _Redis:
    """The soak's redis-server: ACL users from a file and an append-only file, so a kill loses neither."""

    def __init__(self, work: Path, maxmemory: int) -> None:
        self.work = work
        self.maxmemory = maxmemory
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.users = {"operator": ("scd-operator", "op-pw", None), "producer": ("scd-producer", "prod-pw", SPACE),
                      "consumer": ("scd-consumer", "cons-pw", None)}
        lines = ["user default on nopass ~* &* +@all"]
        for role, (user, password, space) in self.users.items():
            lines.append("user " + " ".join(acl_setuser(role, user, password, space)[2:]))
        (work / "users.acl").write_text("\n".join(lines) + "\n")

    def start(self) -> None:
        from scd_store.bench.store import _start_redis

        settings = [arg for name, value in SERVER_SETTINGS for arg in (f"--{name}", value)]  # the recipe's
        self.proc, self.port = _start_redis(self.work, self.port or None, (
            "--appendonly", "yes", "--appendfsync", "always", "--aclfile", str(self.work / "users.acl"),
            "--maxmemory", str(self.maxmemory), *settings))

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def url(self, role: str | None = None) -> str:
        if role is None:
            return f"redis://127.0.0.1:{self.port}/0"
        user, password, _ = self.users[role]
        return f"redis://{user}:{password}@127.0.0.1:{self.port}/0"


def _mount_tmpfs(path: Path, size: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, check=False).returncode == 0


class _Injector:
    """Blob faults in Redis, as an attacker or a broken disk would leave them."""

    def __init__(self, redis_url: str, rng: random.Random) -> None:
        import redis

        self.client = redis.Redis.from_url(redis_url, socket_timeout=5)
        self.rng = rng
        self.injected: dict[str, tuple[str, bytes]] = {}  # key -> (kind, bytes written)

    def wave(self, per_kind: int) -> dict[str, int]:
        from scd_store.store.blob import BlobMeta, encode_blob
        from scd_store.store.signing import SigningKey

        keys = [k.decode() for k in self.client.scan_iter(match=f"scd:{SPACE}:*", count=1000)
                if k.decode() not in self.injected]
        chosen = self.rng.sample(keys, min(len(keys), 3 * per_kind + 1))
        done = dict.fromkeys(KINDS, 0)
        attacker = SigningKey("deployment", bytes(range(32)))  # the real key id, another private key
        for i, key in enumerate(chosen[:3 * per_kind]):
            kind = KINDS[i % 3]
            value = self.client.get(key)
            if value is None:
                continue
            if kind == "corrupted":
                data = bytearray(value)
                data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
                bad = bytes(data)
            elif kind == "forged":
                bad = encode_blob(BlobMeta("raw", FINGERPRINT, CHUNK), b"attacker kv" * 100, key=key, signer=attacker)
            else:
                bad = self.client.get(chosen[-1]) or value  # a genuine blob of another chunk
            self.client.set(key, bad, keepttl=True)
            self.injected[key] = (kind, bad)
            done[kind] += 1
        return done

    def genuine(self, key: str, payload_bytes: int, keyring: Any) -> bool | None:
        """Whether Redis holds ``key``'s genuine blob (None: it holds nothing)."""
        from scd_store.store.blob import BlobError, decode_blob

        value = self.client.get(key)
        if value is None:
            return None
        try:
            blob = decode_blob(value, key=key, space_id=SPACE, keyring=keyring)
        except BlobError:
            return False
        return bytes(blob.payload) == payload_for(key, payload_bytes)

    def outcomes(self, payload_bytes: int, keyring: Any) -> dict[str, dict[str, int]]:
        """Per kind: injected blobs now repaired (a genuine blob again), gone, or still the injected bytes."""
        out = {kind: {"repaired": 0, "gone": 0, "still_there": 0} for kind in KINDS}
        for key, (kind, _) in self.injected.items():
            state = self.genuine(key, payload_bytes, keyring)
            out[kind]["gone" if state is None else "repaired" if state else "still_there"] += 1
        return out

    def plant_next_generation(self, payload_bytes: int, signer: Any) -> list[str]:
        """Genuine blobs of the space's next generation (a rollout in progress): nothing may delete them."""
        from scd_store.store.blob import BlobMeta, encode_blob

        keys = other_generation_keys()
        for key in keys:
            self.client.set(key, encode_blob(BlobMeta("raw", OTHER_FINGERPRINT, CHUNK), payload_for(key, payload_bytes),
                                             key=key, signer=signer))
        return keys


def _spawn(spec: dict[str, Any]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "scd_store.bench.fault_worker", json.dumps(spec)])


def run_fault_soak(config: FaultSoakConfig) -> dict[str, Any]:
    from scd_store.store.host_keys import deployment_keys
    from scd_store.store.keyring import Keyring
    from scd_store.store.records import Pair, Space
    from scd_store.store.registry import RedisRegistry

    rng = random.Random(config.seed)
    with tempfile.TemporaryDirectory(prefix="scd-soak-") as tmp:
        work = Path(tmp)
        private, public = deployment_keys(work / "keys")
        redis = _Redis(work, config.maxmemory)
        redis.start()
        disk = work / "disk"
        mounted = _mount_tmpfs(disk, 16 << 20)
        operator = RedisRegistry(redis.url("operator"))
        operator.register_space(Space(SPACE, PRODUCER, "soak-producer-fp", FINGERPRINT, codec_id="raw",
                                      chunk_size=CHUNK))
        operator.register_pair(Pair(PAIR, SPACE, CONSUMER, "soak-consumer-fp", "soak-pair-fp", FINGERPRINT))
        injector = _Injector(redis.url(), rng)
        next_generation = injector.plant_next_generation(config.payload_bytes, Keyring(private).signer(SPACE))
        stop = work / "stop"
        common = {"stop": str(stop), "prefixes": config.prefixes, "chunks": config.chunks,
                  "payload_bytes": config.payload_bytes, "ttl_s": config.ttl_s,
                  "registry_refresh_s": config.registry_refresh_s, "pause_s": 0.01, "duration_s": config.duration_s,
                  "disk_bytes": 8 << 20}
        roles = ["producer", *["consumer"] * config.processes, "rogue"]
        procs = []
        for i, role in enumerate(roles):
            user = "producer" if role == "producer" else "consumer"
            procs.append(_spawn({**common, "role": role, "seed": config.seed * 1000 + i, "url": redis.url(user),
                                 "keyring": str(private if role == "producer" else public),
                                 "out": str(work / f"worker{i}.json"),
                                 "cpu_bytes": 256 << 10 if role == "producer" else 128 << 10,
                                 "disk": str(disk if role == "producer" else work / "consumer-disk")}))
        injected: dict[str, Any] = {"redis_kills": 0, "disk_fills": 0, "revocations": 0,
                                    **dict.fromkeys(KINDS, 0)}
        t0 = time.monotonic()

        def at(fraction: float) -> None:
            time.sleep(max(0.0, t0 + fraction * config.duration_s - time.monotonic()))

        revoked_at = None
        filler = disk / "filler"
        for fraction, event in ((0.15, "wave"), (0.25, "outage"), (0.35, "wave"), (0.45, "outage"), (0.55, "wave"),
                                (0.60, "fill"), (0.70, "free"), (0.80, "revoke")):
            at(fraction)
            if event == "wave":
                for kind, n in injector.wave(config.per_wave).items():
                    injected[kind] += n
            elif event == "outage":
                redis.kill()
                injected["redis_kills"] += 1
                time.sleep(config.outage_s)
                redis.start()
            elif event == "fill" and mounted:
                with contextlib.suppress(OSError), open(filler, "wb") as f:
                    while True:
                        f.write(b"\0" * (64 << 10))
                injected["disk_fills"] += 1
            elif event == "free" and mounted:
                filler.unlink(missing_ok=True)
            elif event == "revoke":
                revoked_at = time.time()
                injected["revocations"] += len(operator.revoke(PAIR))
        at(1.0)
        stop.write_text("stop")
        codes = [p.wait(timeout=120) for p in procs]
        reports = [json.loads((work / f"worker{i}.json").read_text()) if (work / f"worker{i}.json").exists() else {}
                   for i in range(len(procs))]
        verifier = Keyring(public)
        outcomes = injector.outcomes(config.payload_bytes, verifier)
        integrity = _integrity(injector, reports, next_generation, config.payload_bytes, verifier)
        integrity["redis_evicted_keys"] = int(injector.client.info("stats").get("evicted_keys", 0))
        injector.client.close()
        operator.close()
        redis.kill()
        if mounted:
            subprocess.run(["umount", str(disk)], check=False)
    return _report(config, codes, reports, injected, outcomes, integrity, revoked_at, mounted)


def _integrity(injector: _Injector, reports: list[dict[str, Any]], next_generation: list[str], payload_bytes: int,
               verifier: Any) -> dict[str, Any]:
    """What the rogue's forged reports and the faults did to genuine blobs, and whether every acknowledged put
    is in Redis or counted as lost there."""
    producer, rogue = reports[0], reports[-1].get("rogue", {})
    reported = [k for k in rogue.get("reported_keys", []) if k not in injector.injected]
    this_generation = [k for k in reported if k not in next_generation]
    kept = sum(bool(injector.genuine(k, payload_bytes, verifier)) for k in this_generation
               if injector.client.exists(k))  # a reported key the producer never wrote is no loss
    next_kept = sum(injector.client.get(k) is not None for k in next_generation)
    acknowledged = producer.get("acknowledged", [])
    missing = [k for k in acknowledged if not injector.client.exists(k)]
    redis_counters = producer.get("tier_counters", {}).get("redis", {})
    lost = redis_counters.get("lost_writes", 0) + redis_counters.get("evicted_blobs", 0)
    absent = rogue.get("reported_absent", [])
    return {"rogue_attacks": rogue.get("attacks", {}),
            "rogue_got_through": sum(a["got_through"] for a in rogue.get("attacks", {}).values()),
            "reported_genuine": sum(injector.client.exists(k) > 0 for k in this_generation), "reported_kept": kept,
            "next_generation_blobs": len(next_generation), "next_generation_kept": next_kept,
            "reported_absent": len(absent),
            "reported_absent_written": sum(injector.client.exists(k) > 0 for k in absent),
            "acknowledged_puts": len(acknowledged), "acknowledged_missing_in_redis": len(missing),
            "counted_lost_or_evicted_in_redis": lost, "lost_uncounted": max(0, len(missing) - lost)}


def _report(config: FaultSoakConfig, codes: list[int], reports: list[dict[str, Any]], injected: dict[str, Any],
            outcomes: dict[str, dict[str, int]], integrity: dict[str, Any], revoked_at: float | None,
            mounted: bool) -> dict[str, Any]:
    producer, consumers = reports[0], reports[1:-1]

    def total(name: str, of: list[dict[str, Any]]) -> int:
        return sum(r.get("counters", {}).get(name, 0) for r in of)

    refusal_delays = [r["first_refusal_at"] - revoked_at for r in consumers
                      if revoked_at is not None and r.get("first_refusal_at")]
    detected = {
        "bad_signatures": total("bad_signatures", consumers), "corrupt_blobs": total("corrupt_blobs", consumers),
        "unsafe_files": total("unsafe_files", consumers),
        "quarantined_by_producer": total("quarantined_blobs", [producer]),
        "repaired_by_producer": total("repaired_blobs", [producer]),
        "refused_reports": total("refused_reports", [producer]), "ttl_refreshes": total("ttl_refreshes", [producer]),
        "refused_refreshes": total("refused_refreshes", [producer]),
        "evicted_blobs": total("evicted_blobs", [producer]),
        "rogue_unsigned_puts": total("unsigned_puts", reports[-1:]),
        "redis_incidents": sum(r.get("incidents", {}).get("redis", 0) for r in reports[:-1]),  # not the rogue's
        "disk_errors": producer.get("tier_counters", {}).get("disk", {}).get("tier_errors", 0) if mounted else 0,
        "consumers_refusing_after_revocation": len(refusal_delays),
    }
    garbage = sum(r.get("garbage", 0) for r in consumers)
    ok = (garbage == 0 and all(c == 0 for c in codes) and len(refusal_delays) == config.processes
          and max(refusal_delays, default=0.0) < config.registry_refresh_s + 2.0
          and integrity["rogue_got_through"] == 0 and integrity["reported_kept"] == integrity["reported_genuine"]
          and integrity["next_generation_kept"] == integrity["next_generation_blobs"]
          and integrity["lost_uncounted"] == 0 and integrity["reported_absent_written"] == 0)
    return {
        "ok": ok, "garbage_decodes": garbage, "injected": injected, "detected": detected, "outcomes": outcomes,
        "integrity": integrity,
        "not_injected": [] if mounted else ["disk fill: cannot mount a tmpfs here (needs root)"],
        "requests": {"completed": sum(r.get("requests", 0) for r in reports),
                     "failed": sum(r.get("errors", 0) for r in reports),
                     "first_failure": next((r["first_error"] for r in reports if r.get("first_error")), ""),
                     "chunks_served": sum(r.get("served", 0) for r in consumers),
                     "chunks_put": producer.get("puts", 0),
                     "refused_after_revocation": sum(r.get("refusals", 0) for r in consumers)},
        "revocation_seen_after_s": [round(d, 3) for d in refusal_delays],
        "latency_ms": {r["role"] + str(i): {"p50": r.get("p50_ms"), "p99": r.get("p99_ms")}
                       for i, r in enumerate(reports) if r},
        "producer_counters": producer.get("counters", {}), "producer_tier_counters": producer.get("tier_counters", {}),
        "consumer_counters": {
            name: total(name, consumers) for name in sorted({n for r in consumers for n in r.get("counters", {})})},
        "unwritten_at_close": producer.get("unwritten", {}), "exit_codes": codes, "config": asdict(config),
    }
