"""``scd-store stats`` over damaged snapshot files: junk is skipped, labels are printed as text, never as markup."""

from __future__ import annotations

import json

import pytest

from scd_store.cli.main import main


def _snapshot(label: str) -> dict:
    return {"process": {"id": label, "name": "[bold red]engine", "host": "h", "pid": 1, "updated": "soon"},
            "counters": [{"name": "hit_tokens", "tier": "cpu", "space": "sp", "pair": label, "value": 4096},
                         {"name": "requested_tokens", "tier": "", "space": "sp", "pair": label, "value": "lots"},
                         {"name": "bogus", "tier": "", "space": "sp", "pair": label, "value": 1}],
            "latency": [{"op": "[/op]", "tier": "", "pair": label, "buckets": [1] * 17}]}


def test_stats_over_junk_files_survives(tmp_path, capsys) -> None:
    (tmp_path / "a.json").write_text(json.dumps(_snapshot("sp/[/x]")))
    (tmp_path / "b.json").write_text("[" * 50_000)
    for args in ([], ["--counters"], ["--json"]):
        assert main(["stats", "--file", str(tmp_path), *args]) == 0
        out = capsys.readouterr().out
        assert "4,096" in out or '"value": 4096' in out
        assert "[/x]" in out and "bogus" not in out and "lots" not in out
    assert main(["stats", "--file", str(tmp_path / "a.json"), "--counters"]) == 0
    out = capsys.readouterr().out
    assert "[bold red]engine" in out and "[/op]" in out


def test_a_file_that_is_no_snapshot_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "x.json").write_text('{"counters": "no"}')
    with pytest.raises(SystemExit, match="no stats snapshot"):
        main(["stats", "--file", str(tmp_path / "x.json")])


def test_processes_are_named_by_the_models_they_serve_and_their_roles(tmp_path, capsys) -> None:
    from scd_store.store.stats import StoreStats
    from scd_store.store.stats_sinks import ProcessInfo, SnapshotFiles

    for pid, serves in ((11, {"smollm2-base": "producer"}), (12, {"ft-shakespeare": "consumer"}), (13, {})):
        stats = StoreStats()
        stats.inc("requested_tokens", 256, space="s", pair="s/c")
        stats.describe_process(lambda serves=serves: serves)
        SnapshotFiles(tmp_path, ProcessInfo("host", pid, "api_server.py")).flush(stats)
    assert main(["stats", "--file", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "producer smollm2-base" in out and "consumer ft-shakespeare" in out
    assert "api_server.py" in out  # a process that names no model keeps its program's name
