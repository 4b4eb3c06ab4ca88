"""Per-process stats: snapshot files on one host add up, each process keeps its own row."""

from __future__ import annotations

import json

from scd_store.store.stats import StoreStats, merge_snapshots
from scd_store.store.stats_sinks import ProcessInfo, SnapshotFiles, read_snapshot_files


def counted(requested: int, hit: int, decode_s: float) -> StoreStats:
    stats = StoreStats()
    stats.inc("requested_tokens", requested, space="s", pair="s/c")
    stats.record_hit(tier="cpu", space="s", pair="s/c", chunks=hit // 256, tokens=hit, nbytes=1000,
                     raw_kv_bytes_per_token=10)
    stats.observe("decode", decode_s, pair="s/c")
    return stats


def test_two_processes_files_add_up(tmp_path):
    a, b = ProcessInfo("host", 100, "engine-a"), ProcessInfo("host", 200, "engine-b")
    SnapshotFiles(tmp_path, a).flush(counted(1024, 512, 0.002))
    SnapshotFiles(tmp_path, b).flush(counted(512, 512, 0.02))
    (tmp_path / "garbage.json").write_text("{not json")  # skipped, not fatal
    view = read_snapshot_files(tmp_path)
    assert sorted(p["process"]["id"] for p in view["processes"]) == ["host-100", "host-200"]
    total = {c["name"]: c["value"] for c in view["counters"] if c["pair"] == "s/c"}
    assert total["requested_tokens"] == 1536 and total["hit_tokens"] == 1024
    (decode,) = [h for h in view["latency"] if h["op"] == "decode"]
    assert decode["count"] == 2 and decode["pair"] == "s/c" and decode["p99_le_s"] == 0.025


def test_a_flush_rewrites_the_whole_snapshot(tmp_path):
    stats = counted(256, 256, 0.001)
    sink = SnapshotFiles(tmp_path, ProcessInfo("h", 1, "p"))
    sink.flush(stats)
    stats.inc("requested_tokens", 256, space="s", pair="s/c")
    sink.flush(stats)
    data = json.loads(sink.path.read_text())
    assert data["process"]["name"] == "p" and data["process"]["updated"] >= data["process"]["started"]
    assert {c["name"]: c["value"] for c in data["counters"]}["requested_tokens"] == 512
    assert list(tmp_path.iterdir()) == [sink.path]  # no temp files left


def test_merging_keeps_histograms_exact():
    one, two = counted(1, 1, 0.0001).snapshot(), counted(1, 1, 0.5).snapshot()
    merged = merge_snapshots([one, two])
    (decode,) = [h for h in merged["latency"] if h["op"] == "decode"]
    assert decode["count"] == 2 and decode["p50_le_s"] == 0.0001 and decode["p99_le_s"] == 0.5


def test_files_of_long_gone_processes_are_pruned(tmp_path):
    import os

    me = ProcessInfo.current("me")
    gone = tmp_path / f"{me.host}-999999999.json"  # no such pid
    recent = tmp_path / f"{me.host}-999999998.json"
    alive = tmp_path / f"{me.host}-{os.getpid()}.json"
    elsewhere = tmp_path / "another-host-999999999.json"
    for path in (gone, recent, alive, elsewhere):
        path.write_text("{}")
    for path in (gone, alive, elsewhere):
        os.utime(path, (1000, 1000))  # written long ago
    SnapshotFiles(tmp_path, me)
    assert not gone.exists() and recent.exists() and alive.exists() and elsewhere.exists()


def test_damaged_snapshot_files_are_skipped_or_cleaned(tmp_path):
    """Snapshot files with junk of every kind: skipped (not a snapshot) or cleaned (fields not of the schema)."""
    from scd_store.store.stats_sinks import process_record

    SnapshotFiles(tmp_path, ProcessInfo("host", 100, "engine-a")).flush(counted(1024, 512, 0.002))
    junk = {"deep.json": "[" * 100_000, "list.json": "[1, 2]", "no-counters.json": '{"counters": 3}',
            "bad-entries.json": json.dumps({
                "process": {"id": "[/x]", "pid": "one", "updated": "now", "host": 3},
                "counters": [1, None, {"name": "puts", "tier": "", "space": "s", "pair": "", "value": "many"},
                             {"name": "puts", "tier": "", "space": "s", "pair": "", "value": 2 ** 70},
                             {"name": "nope", "tier": "", "space": "s", "pair": "", "value": 1},
                             {"name": "puts", "tier": "", "space": "s", "pair": "", "value": 3}],
                "latency": [{"op": "get", "tier": "", "pair": "", "buckets": ["x", 1.5, -1, 4] + [9] * 40}, 7]})}
    for name, text in junk.items():
        (tmp_path / name).write_text(text)
    view = read_snapshot_files(tmp_path)
    assert sorted(p["process"].get("id", "") for p in view["processes"]) == ["[/x]", "host-100"]
    cleaned = next(p for p in view["processes"] if p["process"].get("id") == "[/x]")
    assert cleaned["process"] == {"id": "[/x]"}
    assert cleaned["counters"] == [{"name": "puts", "tier": "", "space": "s", "pair": "", "value": 3}]
    assert cleaned["latency"][0]["buckets"][3] == 4 and cleaned["latency"][0]["count"] == 4 + 9 * 13
    assert {c["name"] for c in view["counters"]} >= {"puts", "requested_tokens"}
    assert process_record("[" * 3000) is None and process_record(b"x" * 5000) is None
    assert process_record('{"updated": NaN, "started": 1e999, "pid": true}') == {}


def test_a_process_record_names_the_models_it_serves_and_their_roles(tmp_path):
    stats = counted(1024, 512, 0.002)
    stats.describe_process(lambda: {"base": "producer", "ft-b": "consumer", "ft-a": "consumer"})
    SnapshotFiles(tmp_path, ProcessInfo("host", 100, "api_server.py")).flush(stats)
    (record,) = [p["process"] for p in read_snapshot_files(tmp_path)["processes"]]
    assert record["serves"] == {"base": "producer", "ft-a": "consumer", "ft-b": "consumer"}


def test_hostile_or_oversized_serves_are_dropped_on_read(tmp_path):
    from scd_store.store.stats_sinks import MAX_RECORD_BYTES, process_record

    base = {"host": "h", "pid": 1, "name": "x", "id": "h-1"}
    assert "serves" not in process_record({**base, "serves": {"m": "admin"}})  # not a role
    assert "serves" not in process_record({**base, "serves": {"a|b": "producer"}})  # not a label
    assert "serves" not in process_record({**base, "serves": {f"m{i}": "consumer" for i in range(17)}})
    assert "serves" not in process_record({**base, "serves": ["producer"]})
    # a writer keeps its own record under the size readers accept, dropping models that do not fit
    record = ProcessInfo("h", 1, "x").record({f"model-{i:03d}-{'x' * 240}": "consumer" for i in range(40)})
    assert len(json.dumps(record)) <= MAX_RECORD_BYTES and 0 < len(record["serves"]) < 16


def test_a_failing_description_never_breaks_a_flush(tmp_path):
    stats = counted(1024, 512, 0.002)
    stats.describe_process(lambda: 1 / 0)
    SnapshotFiles(tmp_path, ProcessInfo("host", 100, "p")).flush(stats)
    assert "serves" not in read_snapshot_files(tmp_path)["processes"][0]["process"]
