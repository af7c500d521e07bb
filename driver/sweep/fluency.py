"""Whether a configuration's generations stay fluent, judged against the baseline's own generations.

The unsteered model's per-token log-likelihood of each steered text (`fluency_logprob`) and the fraction of its
word 3-grams that repeat an earlier one (`repetition_rate`), both relative to the baseline's own generations.

A configuration is degenerate (not fluent) when, on some prompt set, its texts' mean `fluency_logprob` is more
than LOGPROB_MARGIN nats/token below the baseline's, its mean `repetition_rate` more than REPETITION_MARGIN
above the baseline's, or more than EMPTY_MARGIN more of its generations are empty. The report's "best"
configuration is chosen among fluent ones only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from worker.spec import NO_STEERING

from driver.sweep.rows import BASELINE, EMPTY, finite, mean_stderr

NGRAM = 3
LOGPROB_MARGIN = 1.5  # nats per token
REPETITION_MARGIN = 0.2
EMPTY_MARGIN = 0.25
METRICS = {"fluency_logprob": True, "repetition_rate": False}  # metric: higher is better


def repetition_rate(text: str, n: int = NGRAM) -> float:
    """Fraction of the text's word n-grams that repeat an earlier one (0: none; "of of of of …": near 1)."""
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def baseline_scores(executor, encode: Callable[[str, str], tuple], texts: Sequence[tuple[str, str]]) -> dict[tuple[str, str], float | None]:
    """{(prompt, text): the unsteered model's mean log-prob per token of `text` after `prompt`} for every non-empty
    text, through the executor's grid (cached like every other request); None where it is not finite."""
    pairs = sorted({(p, t) for p, t in texts if t})
    if not pairs:
        return {}
    requests = [encode(p, t) for p, t in pairs]
    answers = executor.run_grid("loglikelihood", [NO_STEERING], requests)[0]
    out: dict[tuple[str, str], float | None] = {}
    for pair, (_, cont), (logprob, _) in zip(pairs, requests, answers):
        out[pair] = logprob / len(cont) if finite(logprob) and cont else None
    return out


def rows(texts: Sequence[tuple[str, str]], scores: dict[tuple[str, str], float | None], failed: str | None = None) -> list[tuple]:
    """(metric, value, stderr, n, error) of one configuration's generations on one prompt set (`failed`: why it
    has none)."""
    said = [pair for pair in texts if pair[1]]
    if failed or not said:
        return [(m, None, None, 0, failed or EMPTY) for m in METRICS]
    logprobs = [scores.get(pair) for pair in said]
    if any(v is None for v in logprobs):
        failed = ("fluency_logprob", None, None, len(said), "non-finite log-likelihood of a generation under the baseline")
    else:
        failed = ("fluency_logprob", *mean_stderr(logprobs), len(said), None)
    return [failed, ("repetition_rate", *mean_stderr([repetition_rate(t) for _, t in said]), len(said), None)]


def empty_share(generations: Sequence[dict], config: str, prompt_set: str) -> float:
    mine = [g for g in generations if g["config"] == config and g["prompt_set"] == prompt_set]
    return sum(1 for g in mine if not g["text"]) / len(mine) if mine else 0.0


def mark(rows_: list[dict], generations: list[dict]) -> None:
    """Set every row's `fluent` (True/False; None where its configuration has no generations) and flag empty
    generations."""
    values = {(r["config"], r["task"], r["metric"]): r["value"] for r in rows_ if r["metric"] in METRICS}
    sets = {(g["config"], g["prompt_set"]) for g in generations}
    verdict: dict[str, bool] = {}
    for config, name in sorted(sets):
        ok = _fluent(values, generations, config, name)
        verdict[config] = verdict.get(config, True) and ok
    for r in rows_:
        r["fluent"] = verdict.get(r["config"])
    for g in generations:
        g["fluent"] = verdict.get(g["config"])
        g["empty"] = not g["text"]


def _fluent(values: dict, generations: list[dict], config: str, name: str) -> bool:
    return not reasons(values, generations, config, name)


def why_not(rows_: Sequence[dict], generations: Sequence[dict]) -> dict[str, list[str]]:
    """{configuration: why it is not fluent, one reason per failed measure and prompt set} for summary.md; a
    fluent configuration is absent."""
    values = {(r["config"], r["task"], r["metric"]): r["value"] for r in rows_ if r["metric"] in METRICS}
    out: dict[str, list[str]] = {}
    for config, name in sorted({(g["config"], g["prompt_set"]) for g in generations}):
        for why in reasons(values, generations, config, name):
            out.setdefault(config, []).append(f"{name}: {why}")
    return out


def reasons(values: dict, generations: Sequence[dict], config: str, name: str) -> list[str]:
    """Why `config` is not fluent on prompt set `name`: each measure past its margin, with its value, the threshold
    and the baseline's value it is made from; [] when fluent."""
    if config == BASELINE:
        return []  # the reference
    logprob, base_logprob = values.get((config, name, "fluency_logprob")), values.get((BASELINE, name, "fluency_logprob"))
    rep, base_rep = values.get((config, name, "repetition_rate")), values.get((BASELINE, name, "repetition_rate"))
    if logprob is None or rep is None:
        return ["no generation to judge, or one scores non-finite under the unsteered model"]
    out = []
    if base_logprob is not None and logprob < base_logprob - LOGPROB_MARGIN:
        out.append(f"fluency_logprob {logprob:.2f} < {base_logprob - LOGPROB_MARGIN:.2f} (the baseline's {base_logprob:.2f} − {LOGPROB_MARGIN:g})")
    if base_rep is not None and rep > base_rep + REPETITION_MARGIN:
        out.append(f"repetition_rate {rep:.2f} > {base_rep + REPETITION_MARGIN:.2f} (the baseline's {base_rep:.2f} + {REPETITION_MARGIN:g})")
    share, base_share = empty_share(generations, config, name), empty_share(generations, BASELINE, name)
    if share > base_share + EMPTY_MARGIN:
        out.append(f"empty generations {share:.0%} > {base_share + EMPTY_MARGIN:.0%} (the baseline's {base_share:.0%} + {EMPTY_MARGIN:.0%})")
    return out
