"""What a consumer server answers from codes, against its own answer and against raw-KV reuse, and
against scd-store's own transformers decode path on the same codes (engine fidelity).

For each held-out window of the consumer's corpus: the producer server stores the window's prefix;
the consumer server answers prefix + tail greedily by each route (own prefill, codes, raw KV); and
this process decodes the same stored codes and continues them with the consumer in transformers.
All in one run; every figure is measured.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from scd_store.adapters.transformers import LoadedModel, continue_with_prefix, greedy_logprobs, prefill_capture
from scd_store.adapters.transformers.inject import mean_kl
from scd_store.bench.intervals import bootstrap_mean, bootstrap_paired
from scd_store.bench.metrics import common_prefix
from scd_store.bench.serving import ROUTES, Deployment
from scd_store.bench.vllm_server import choice_tokens
from scd_store.codecs.kv_state import KVState
from scd_store.models import catalog
from scd_store.models.windows import eval_windows


def position_match(answer: list[int], own: list[int]) -> float:
    """The share of the consumer's own answer's positions where ``answer`` has the same token."""
    return sum(x == y for x, y in zip(answer, own, strict=False)) / max(1, len(own))


def next_token_scores(consumer: LoadedModel, producer: LoadedModel, prefix: list[int], codes: KVState,
                      rest: list[int]) -> dict[str, tuple[float, float]]:
    """``{route: (top-1, KL)}`` of the consumer's next-token distributions over ``rest`` (its tail and its own
    answer) after ``prefix`` held as decoded codes and as the producer's raw KV, against its own prefill."""
    own, raw = prefix_states(consumer, producer, prefix)
    return scores_given(consumer, own, {"scd": codes, "raw": raw}, rest)


def prefix_states(consumer: LoadedModel, producer: LoadedModel, prefix: list[int]) -> tuple[KVState, KVState]:
    """The consumer's own prefill of ``prefix`` and the producer's (raw KV reuse)."""
    own, _ = prefill_capture(consumer.model, torch.tensor(prefix))
    raw, _ = prefill_capture(producer.model, torch.tensor(prefix))
    return own, raw


def scores_given(consumer: LoadedModel, own: KVState, states: dict[str, KVState],
                 rest: list[int]) -> dict[str, tuple[float, float]]:
    """``{route: (top-1, KL)}``: the consumer continued over ``rest`` from each route's prefix state, against
    its continuation from its ``own`` prefill, position by position (teacher-forced)."""
    ids = torch.tensor(rest)
    oracle = continue_with_prefix(consumer.model, own, ids)
    out = {}
    for route, state in states.items():
        logits = continue_with_prefix(consumer.model, state, ids)
        out[route] = (float((logits.argmax(-1) == oracle.argmax(-1)).float().mean()), mean_kl(logits, oracle))
    return out


def consumer_agreement(deployment: Deployment, consumer: LoadedModel, windows: int, prefix_tokens: int,
                       tail_tokens: int, new_tokens: int, seed: int = 7,
                       producer: LoadedModel | None = None) -> dict[str, Any]:
    """Greedy agreement per route with the consumer's own answer, and fidelity to the transformers path. With
    ``producer``, also each window's next-token top-1 and KL against the consumer's own prefill, teacher-forced
    along its tail and own answer (:func:`next_token_scores`): a far less noisy measure than free-running
    greedy answers, which part for good at their first different token."""
    base, server = deployment.servers[deployment.producer], deployment.servers[consumer.name]
    corpus = catalog.consumer(consumer.name).corpus if consumer.name in catalog.CONSUMERS else "shakespeare"
    answers: dict[str, list[list[int]]] = {route: [] for route in ROUTES}
    fidelity = {"tokens": 0, "equal": 0, "logprob_diffs": []}
    scores: dict[str, list[tuple[float, float]]] = {"scd": [], "raw": []}
    for window in eval_windows(consumer.tokenizer, corpus, windows, prefix_tokens + tail_tokens, seed=seed):
        prompt = [int(t) for t in window]
        base.complete(deployment.producer, prompt[:prefix_tokens], 1)
        covered = deployment.wait_stored(prompt[:prefix_tokens])
        got = {route: server.complete(consumer.name, prompt, new_tokens, kv_params=params)
               for route, params in ROUTES.items()}
        for route, response in got.items():
            answers[route].append(choice_tokens(response)[0])
        codes = deployment.stored_codes(consumer.name, prompt[:covered])
        want, want_lp = greedy_logprobs(consumer.model, codes, torch.tensor(prompt[covered:]),
                                        new_tokens)
        tokens, logprobs = choice_tokens(got["scd"])
        same = common_prefix(tokens, want)
        fidelity["tokens"] += len(want)
        fidelity["equal"] += same
        fidelity["logprob_diffs"] += [abs(a - b) for a, b in zip(logprobs[:same], want_lp[:same], strict=True)]
        if producer is not None:
            window_scores = next_token_scores(consumer, producer, prompt[:covered], codes,
                                              prompt[covered:] + answers["own"][-1])
            for route, score in window_scores.items():
                scores[route].append(score)
    own = answers["own"]
    routes, per_window = {}, {}
    for route in ("scd", "raw"):
        pairs = list(zip(answers[route], own, strict=True))
        per_window[route] = [position_match(a, b) for a, b in pairs]
        routes[route] = {
            "exact_answers": sum(a == b for a, b in pairs), "answers": len(pairs),
            "agreed_prefix_tokens_mean": round(statistics.mean(common_prefix(a, b) for a, b in pairs), 2),
            "position_match": round(sum(x == y for a, b in pairs for x, y in zip(a, b, strict=False))
                                    / max(1, sum(len(b) for _, b in pairs)), 3),
            "position_match_per_window": bootstrap_mean(per_window[route]).as_dict(),
            "position_match_windows": [round(v, 4) for v in per_window[route]]}
    diffs = fidelity["logprob_diffs"]
    extra = {"next_token": next_token_report(scores)} if producer is not None else {}
    return {"consumer": consumer.name, "windows": windows, "prefix_tokens": prefix_tokens, "tail_tokens": tail_tokens,
            "new_tokens": new_tokens, "against_own_answer": routes, **extra,
            "scd_minus_raw_position_match": bootstrap_paired(per_window["scd"], per_window["raw"]).as_dict(),
            "engine_fidelity": {"what": "the server's greedy tokens from codes against scd-store's transformers "
                                        "decode path on the same stored codes",
                                "tokens_equal_before_first_difference": f"{fidelity['equal']} of {fidelity['tokens']}",
                                "logprob_abs_diff_max": round(max(diffs), 6) if diffs else None,
                                "logprob_abs_diff_mean": round(statistics.mean(diffs), 6) if diffs else None}}


def next_token_report(scores: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """Per route, the windows' mean top-1 and KL with intervals, and the paired codes-minus-raw differences."""
    top1 = {route: [t for t, _ in values] for route, values in scores.items()}
    kl = {route: [k for _, k in values] for route, values in scores.items()}
    return {"what": "teacher-forced along the consumer's tail and own answer, against its own prefill",
            **{route: {"top1": bootstrap_mean(top1[route]).as_dict(), "kl": bootstrap_mean(kl[route]).as_dict()}
               for route in scores},
            "scd_minus_raw_top1": bootstrap_paired(top1["scd"], top1["raw"]).as_dict(),
            "scd_minus_raw_kl": bootstrap_paired(kl["scd"], kl["raw"]).as_dict()}
