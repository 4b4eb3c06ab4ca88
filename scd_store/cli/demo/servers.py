"""The demo on real vLLM servers: a base-model server prefills a shared system prompt once; fine-tune
servers answer OpenAI-compatible requests from its codes.

Every consumer request is sent three ways to its fine-tune's server: its own prefill (no cache),
scd-store's codes, and the producer's raw KV (what a plain KV store would reuse). Per request: time to
first token measured at this client (streamed); how close each route keeps the fine-tune to its own
prefill, next token by next token along its own answer (teacher-forced top-1 and KL, from the same
stored codes the server loaded); how many first greedy tokens agree (a coarse, secondary measure); the
bytes a hit moves. ``scd-store stats`` closes the run.
"""

from __future__ import annotations

from pathlib import Path
from statistics import mean

from rich.console import Console
from rich.table import Table

from scd_store.adapters.transformers import LoadedModel
from scd_store.bench.intervals import Interval
from scd_store.bench.metrics import common_prefix
from scd_store.bench.serve_agreement import consumer_agreement, prefix_states, scores_given
from scd_store.bench.serving import ROUTES, Deployment
from scd_store.cli.demo.prompts import REQUESTS, SYSTEM_PROMPT
from scd_store.cli.tables import one_line
from scd_store.paths import data_dir

LABELS = {"own": "own prefill", "scd": "scd codes", "raw": "raw KV reuse"}
CAPTION = ("next token: the fine-tune continued along its own answer from each route's prefix, against its own "
           "prefill at every position (top-1: the same most likely token; KL in nats). Greedy first tokens: "
           "free-running answers part for good at their first different token, so one early difference hides "
           "everything after it; read it beside the next-token columns.")


def serve_consumer(deployment: Deployment, consumer: LoadedModel, producer: LoadedModel, prefix: list[int],
                   covered: int, new_tokens: int, console: Console) -> list[dict]:
    """Each of the consumer's demo requests, three ways; prints its table and answers."""
    server = deployment.servers[consumer.name]
    codes = deployment.stored_codes(consumer.name, prefix[:covered])
    own_state, raw_state = prefix_states(consumer, producer, prefix[:covered])
    rows = []
    requests = REQUESTS[consumer.name]
    for i, text in enumerate(requests, 1):
        console.print(f"  {consumer.name}: request {i} of {len(requests)}, own prefill / codes / raw KV ...")
        prompt = prefix + consumer.tokenizer(text, add_special_tokens=False)["input_ids"]
        answers = {route: server.stream(consumer.name, prompt, new_tokens, kv_params=params)
                   for route, params in ROUTES.items()}
        own = answers["own"].token_ids
        scores = scores_given(consumer, own_state, {"scd": codes, "raw": raw_state}, prompt[covered:] + own)
        rows.append({"request": text, "answers": answers, "bytes": deployment.hit_bytes(prompt), "scores": scores,
                     "same": {route: common_prefix(a.token_ids, own) for route, a in answers.items()},
                     "tokens": len(own)})
    table = Table(title=f"{consumer.name}: {len(prefix)}-token shared prefix stored once by the base model",
                  caption=CAPTION)
    for column in ("request", "TTFT at the client: own / codes / raw", "next token top-1: codes / raw",
                   "next token KL: codes / raw", "greedy first tokens as own: codes / raw",
                   "bytes moved: codes / raw KV"):
        table.add_column(column)
    for r in rows:
        a, s = r["answers"], r["scores"]
        table.add_row(one_line(r["request"], 32), " / ".join(f"{a[k].ttft_s * 1e3:.0f}" for k in ROUTES) + " ms",
                      f"{s['scd'][0] * 100:.0f}% / {s['raw'][0] * 100:.0f}%", f"{s['scd'][1]:.3f} / {s['raw'][1]:.3f}",
                      f"{r['same']['scd']} / {r['same']['raw']} of {r['tokens']}",
                      f"{r['bytes']['scd'] / 2**20:.2f} / {r['bytes']['raw'] / 2**20:.2f} MiB")
    console.print(table)
    for r in rows:
        console.print(f"[bold]{one_line(r['request'], 60)}[/bold]")
        for route in ROUTES:
            console.print(f"  {LABELS[route] + ':':14} {one_line(r['answers'][route].text, 140)}")
    return rows


def summary_line(name: str, rows: list[dict]) -> str:
    """One fine-tune's requests in a line: mean TTFT per route, next-token top-1 and KL for codes and raw KV."""
    ttft = " / ".join(f"{mean(r['answers'][k].ttft_s for r in rows) * 1e3:.0f} ms" for k in ROUTES)
    top1 = {k: mean(r["scores"][k][0] for r in rows) * 100 for k in ("scd", "raw")}
    kl = {k: mean(r["scores"][k][1] for r in rows) for k in ("scd", "raw")}
    return (f"  {name}: next token top-1 codes {top1['scd']:.1f}% vs raw KV {top1['raw']:.1f}%, KL "
            f"{kl['scd']:.3f} vs {kl['raw']:.3f}; TTFT own / codes / raw {ttft} (means over {len(rows)} requests)")


def agreement_table(results: list[dict], console: Console) -> None:
    """Over held-out requests, with intervals: next-token top-1 and KL against each fine-tune's own prefill (the
    measure to read), then position-by-position agreement of free greedy answers (coarse)."""
    table = Table(title="Held-out requests: next token, given the fine-tune's own text so far (its tail and own "
                        "answer, 48 tokens a request): top-1 and KL against its own prefill [95% bootstrap interval]")
    for column in ("fine-tune", "top-1: scd codes", "top-1: raw KV", "top-1: codes minus raw (paired)",
                   "KL: scd codes", "KL: raw KV"):
        table.add_column(column)
    for r in results:
        scores = r.get("next_token")
        if scores is None:
            continue
        top1 = [Interval(**scores[k]["top1"]).text() for k in ("scd", "raw")]
        diff = scores["scd_minus_raw_top1"]
        table.add_row(r["consumer"], *top1, f"{diff['mean'] * 100:+.1f} points [{diff['low'] * 100:+.1f}, "
                      f"{diff['high'] * 100:+.1f}]", *(Interval(**scores[k]["kl"]).text(percent=False)
                                                      for k in ("scd", "raw")))
    console.print(table)
    table = Table(title="Greedy answers on held-out requests, token by token, against each fine-tune's own answer "
                        "(mean over requests [95% bootstrap interval])")
    for column in ("fine-tune", "requests", "scd codes", "raw KV reuse", "codes minus raw (paired)"):
        table.add_column(column)
    for r in results:
        routes, diff = r["against_own_answer"], r["scd_minus_raw_position_match"]
        table.add_row(r["consumer"], str(r["windows"]),
                      *(Interval(**routes[k]["position_match_per_window"]).text() for k in ("scd", "raw")),
                      f"{diff['mean'] * 100:+.1f} points [{diff['low'] * 100:+.1f}, {diff['high'] * 100:+.1f}]")
    console.print(table)
    console.print("Each request: a held-out window of the fine-tune's own text, its 512-token prefix stored once by "
                  "the base model, a 32-token tail, 16 greedy tokens. Greedy answers part for good at their first "
                  "different token, so token-by-token agreement of free answers is noisy; the next-token table scores "
                  "every position given the fine-tune's own text, from the same stored codes the servers loaded "
                  "(decoded by scd-store, which the servers' tokens match: bench serve's engine fidelity).")


def run_server_demo(producer: LoadedModel, consumers: list[LoadedModel], bundle: Path, new_tokens: int,
                    redis_url: str | None, console: Console, root: Path | None = None,
                    agreement_requests: int = 6) -> int:
    """Start the servers, store the shared prefix through the producer, serve every consumer request, then
    measure agreement over ``agreement_requests`` held-out requests per fine-tune (servers' store, logs and
    stats under ``root``, default ``<data dir>/demo-vllm``)."""
    from scd_store.cli.stats_cmd import print_view
    from scd_store.store.stats_sinks import read_redis_stats, read_snapshot_files

    root = root or data_dir() / "demo-vllm"
    console.print(f"[bold]Starting vLLM servers[/bold]: {producer.name} (producer) and "
                  f"{', '.join(c.name for c in consumers)}; logs in {root / 'logs'}")
    with Deployment(root, bundle, producer.name, [c.name for c in consumers], redis_url=redis_url) as deployment:
        prefix = producer.tokenizer(SYSTEM_PROMPT)["input_ids"]
        produced = deployment.servers[producer.name].stream(producer.name, prefix, 1)
        covered = deployment.wait_stored(prefix)
        console.print(f"[bold]{producer.name}[/bold] prefilled the shared prefix once: {len(prefix)} tokens, first "
                      f"token after {produced.ttft_s * 1e3:.0f} ms at the client; {covered // 256} chunks of 256 "
                      f"stored as codes (and as raw KV, for the baseline) from bundle {bundle.name}.")
        summary = {c.name: serve_consumer(deployment, c, producer, prefix, covered, new_tokens, console)
                   for c in consumers}
        agreement = []
        if agreement_requests:
            console.print(f"[bold]Agreement over {agreement_requests} held-out requests per fine-tune[/bold] "
                          "(each answered three ways and scored; about 5 s a request here)")
            agreement = []
            for c in consumers:
                console.print(f"  {c.name}: {agreement_requests} held-out windows of its own text ...")
                agreement.append(consumer_agreement(deployment, c, agreement_requests, 512, 32, 16, producer=producer))
    console.print("[bold]Codes against raw KV, next token along each fine-tune's own answers[/bold] (against its own "
                  "prefill):")
    for name, rows in summary.items():
        console.print(summary_line(name, rows))
    if agreement:
        agreement_table(agreement, console)
    if redis_url is None:
        print_view(read_snapshot_files(root / "stats"), f"the demo's servers: scd-store stats --file {root / 'stats'}")
    else:
        print_view(read_redis_stats(redis_url), f"the demo's servers: scd-store stats --redis {redis_url}")
    return 0
