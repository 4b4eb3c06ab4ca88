import json

from scd_store.bench.pareto import frontier, pareto_points, plot_reports


def _report(consumer: str) -> dict:
    methods = [("oracle", 0.0, 0.0), ("none", 0.0, 0.8), ("raw", 1.0, 0.05), ("int4", 0.27, 0.06),
               ("scd:a", 0.25, 0.02), ("scd:b", 0.12, 0.03)]
    return {"consumer": consumer, "windows": 2, "prefix_tokens": 64,
            "methods": [{"name": n, "payload_ratio": r, "ppl_rel": p, "kl": p / 2, "top1": 1 - p,
                         "intervals": {"kl": {"low": p / 3, "high": p}} if n.startswith("scd") else {}}
                        for n, r, p in methods]}


def test_points_skip_the_references():
    names = [name for name, _, _ in pareto_points(_report("c"))]
    assert names == ["raw", "int4", "scd:a", "scd:b"]


def test_plot_writes_one_png_for_several_reports(tmp_path):
    paths = []
    for consumer in ("a", "b"):
        paths.append(tmp_path / f"{consumer}.json")
        paths[-1].write_text(json.dumps(_report(consumer)))
    out = plot_reports(paths, tmp_path / "plots" / "pareto.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_the_frontier_keeps_points_no_cheaper_point_beats():
    points = [("a", 0.1, 0.5), ("b", 0.2, 0.6), ("c", 0.3, 0.2), ("d", 0.4, 0.3)]
    assert frontier(points, lower_is_better=True) == [(0.1, 0.5), (0.3, 0.2)]
    assert frontier(points, lower_is_better=False) == [(0.1, 0.5), (0.2, 0.6)]
    assert [name for name, _, _ in pareto_points(_report("c"), "top1")][:2] == ["raw", "int4"]
