"""A sweep's tidy rows (one per configuration × metric) from its grid answers, and a prompt set's target scores
(summed or per-token mean log-probs) with the one-line warnings about them (targets of unequal token length, prompts
longer than the context window: left-truncated, as lm-eval does).

A non-finite score is never a number: its row has no value and an `error` saying which request failed, and its
configuration is reported failed."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from driver.evidence.records import BASELINE
from driver.evidence.stats import finite, mean_stderr, sigmoid  # here too: where the rows' callers find them

NON_FINITE = "non-finite log-likelihood"
EMPTY = "every generation is empty"  # no value, but not a failure: the configuration is flagged not fluent
FIRED = "fired"  # a conditional configuration's share of rows its condition steered (a task's or prompt set's)
PROMPT_HIGHER = {"logprob_negative": False, FIRED: None}


def _metric(metric: str, values: list[float], bad: list[str]) -> tuple[str, float | None, float | None, int, str | None]:
    """(metric, value, stderr, n, error): no value when any input was non-finite (`bad` names them)."""
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return metric, None, None, len(values), f"{NON_FINITE}: {bad[0]}{more}"
    value, stderr = mean_stderr(values)
    return metric, value, stderr, len(values), None


def prompt_rows(prompts: Sequence, logprobs: dict[tuple[int, str], float], where: str) -> list[tuple]:
    """(metric, value, stderr, n, error) for one configuration on one prompt set; `logprobs[(i, target)]` are the
    target scores (summed or per-token mean, as the prompt set asks)."""
    rows = []
    names = sorted({t for p in prompts for t in p.targets}, key=lambda t: (t not in ("positive", "negative"), t != "positive", t))

    def bad(indices: list[int], targets: Sequence[str]) -> list[str]:
        return [f"target {t!r} of {where} line {prompts[i].line}" for i in indices for t in targets if not finite(logprobs[(i, t)])]

    for t in names:
        have = [i for i, p in enumerate(prompts) if t in p.targets]
        rows.append(_metric(f"logprob_{t}", [logprobs[(i, t)] for i in have], bad(have, [t])))
    both = [i for i, p in enumerate(prompts) if "positive" in p.targets and "negative" in p.targets]
    if both:
        failed = bad(both, ["positive", "negative"])
        diff = [logprobs[(i, "positive")] - logprobs[(i, "negative")] for i in both]
        rows.append(_metric("logprob_diff", diff, failed))
        # p(positive) / (p(positive) + p(negative))
        rows.append(_metric("p_positive", [] if failed else [sigmoid(d) for d in diff], failed))
    return rows


def lm_eval_rows(results: dict, failed: str | None) -> tuple[list[tuple], dict]:
    """(task, metric, value, stderr, n, error) from lm-eval's results, and {(task, metric): higher_is_better};
    `failed`: why none of this configuration's lm-eval numbers can be trusted (a non-finite score), or None."""
    rows, better = [], {}
    n_samples = results.get("n-samples", {})
    for task, metrics in results.get("results", {}).items():
        for name, value in metrics.items():
            if "," not in name or "_stderr," in name or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, filt = name.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            stderr = float(stderr) if finite(stderr) else None
            label = metric if filt == "none" else f"{metric},{filt}"
            n = (n_samples.get(task) or {}).get("effective")
            error = failed or (None if finite(value) else f"lm-eval reported a non-finite {metric}")
            rows.append((task, label, None if error else float(value), None if error else stderr, n, error))
            better[(task, label)] = (results.get("higher_is_better", {}).get(task) or {}).get(metric)
    return rows, better


def fired_rows(per_task: dict[str, dict]) -> list[tuple]:
    """(task, FIRED, share of rows fired, None, rows, None) per task of a conditional configuration's
    {task: {fired, rows}} (lm-eval's results' `orchard_fired`, or a prompt set's)."""
    return [(task, FIRED, f["fired"] / f["rows"], None, f["rows"], None) for task, f in per_task.items() if f["rows"]]


def lm_eval_failure(answers: Sequence) -> str | None:
    """Why a configuration's lm-eval metrics are not numbers: some of its log-likelihoods are non-finite."""
    bad = sum(1 for a in answers if not finite(a[0]))
    return f"{NON_FINITE} in {bad} of {len(answers)} lm-eval requests" if bad else None


def add_deltas(rows: list[dict]) -> None:
    """Each row's change from the baseline's value of the same (task, metric): value − baseline."""
    baseline = {(r["task"], r["metric"]): r["value"] for r in rows if r["config"] == BASELINE}
    for r in rows:
        if "delta" in r:  # measured against its own unsteered value (a feature's activation)
            continue
        b = baseline.get((r["task"], r["metric"]))
        r["delta"] = None if b is None or r["value"] is None else r["value"] - b


def failures(rows: Sequence[dict]) -> dict[str, str]:
    """{configuration: the first reason one of its rows failed (a non-finite score)}."""
    out: dict[str, str] = {}
    for r in rows:
        if r.get("error") and r["error"] != EMPTY and r["config"] not in out:
            out[r["config"]] = f"{r['task']} {r['metric']}: {r['error']}"
    return out


# --- a prompt set's targets ---------------------------------------------------------------------------------


def warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


def score(logprob: float, n_tokens: int, how: str) -> float:
    """A target's score: its summed log-prob (`sum`), or that over its tokens (`mean`)."""
    return logprob / max(1, n_tokens) if how == "mean" else logprob


def unequal_lengths(name: str, per_prompt: Sequence[dict[str, tuple[str, int]]], how: str) -> None:
    """Say once, unless the prompt set chose its `target_score` (`how`), that a prompt's targets differ in token
    length (`per_prompt`: {target: (text, tokens)} per prompt): their summed log-probs are compared."""
    uneven = [p for p in per_prompt if len({n for _, n in p.values()}) > 1]
    if how is not None or not uneven:
        return
    example = ", ".join(f"{t} {text!r} {n} token{'s' if n != 1 else ''}" for t, (text, n) in uneven[0].items())
    warn(
        f"prompt set {name!r}: {len(uneven)} of {len(per_prompt)} prompts have targets of unequal token length (e.g. "
        f"{example}); their summed log-probs (whole-target probabilities) are compared: set `target_score: mean` on the "
        "prompt set for the per-token mean, or `target_score: sum` to keep the sum and silence this"
    )


def truncated(name: str, long_targets: int, long_prompts: int, n_prompts: int, window: int) -> None:
    """Say once how many of a prompt set's texts are longer than the context window (their starts are cut)."""
    parts = [f"{n} {what}" for n, what in ((long_targets, "target requests"), (long_prompts, "generation prompts")) if n]
    if parts:
        warn(
            f"prompt set {name!r} ({n_prompts} prompts): {' and '.join(parts)} are longer than the context window "
            f"({window} tokens) and are left-truncated: shorten the prompts or raise model.max_length"
        )


def count_long(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], window: int) -> int:
    """Scoring requests the model sees cut: (context + continuation)[-(window + 1):] drops their start."""
    return sum(1 for ctx, cont in pairs if len(ctx) + len(cont) > window + 1)
