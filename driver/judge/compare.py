"""What summary.md and run.json say of the evidence configurations: the prompting baselines beside the best
steering configuration, the judge (its model, concept, rubric and how a rating is read) and repeated samples."""

from __future__ import annotations

import math
from collections.abc import Sequence

from driver.judge.rubric import ANSWER, SHIPPED
from driver.judge.schema import PROMPT
from driver.sweep.rows import BASELINE

__all__ = ["summary_lines", "judge_facts", "best"]


def best(rows: Sequence[dict], higher_is_better: bool | None) -> dict | None:
    """The row with the best value (fluent generations only; None when the metric has no better side)."""
    ok = [r for r in rows if r["value"] is not None and math.isfinite(r["value"]) and r.get("fluent") is not False]
    if higher_is_better is None or not ok:
        return None
    return max(ok, key=lambda r: r["value"] if higher_is_better else -r["value"])


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:.4g}"


def _label(r: dict | None) -> str:
    if r is None:
        return "–"
    alpha = "" if r["alpha"] is None else f" α={r['alpha']:g}"
    head = "" if r.get("head") is None else f" head {r['head']}"
    return f"{r['vector']} L{r['layer']} {r['site']}{head} {r['op']}{alpha} ({r['positions']})"


def _prompting(outcome) -> list[str]:
    """Per (task, metric): the best steering configuration beside the best prompting baseline, on the same samples."""
    prompting = outcome.sweep.prompting
    if not prompting:
        return []
    out = ["", "## Prompting baselines", "",
           "Each `prompt:NAME` puts its text before every prompt and task context (the chat template's system message "
           "where the model has one, else the text and a blank line), unsteered:", ""]  # fmt: skip
    out += [f"- `{c.id}`: {c.text!r}" for c in prompting]
    out += ["", "Best values on the same samples (fluent configurations only); which is better says whether steering "
            "beats a prompt (Held-out selection above reports the steering pick on held-out samples):", "",
            "| task | metric | best steering configuration | its value | best prompting baseline | its value | better |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    tables: dict[tuple[str, str], list[dict]] = {}
    for r in outcome.rows:
        tables.setdefault((r["task"], r["metric"]), []).append(r)
    for (task, metric), rows in tables.items():
        hib = outcome.higher_is_better.get((task, metric))
        steer = best([r for r in rows if r["config"] != BASELINE and r.get("op") != PROMPT], hib)
        prompt = best([r for r in rows if r.get("op") == PROMPT], hib)
        if steer is None or prompt is None:
            continue
        sign = 1 if hib else -1
        better = "steering" if sign * steer["value"] > sign * prompt["value"] else "prompting" if steer["value"] != prompt["value"] else "tie"
        out.append(f"| {task} | {metric} | {_label(steer)} | {_num(steer['value'])} | {prompt['config']} | {_num(prompt['value'])} | {better} |")
    return out


def _judge(outcome) -> list[str]:
    plan = outcome.sweep.judge
    if plan is None:
        return []
    spec = outcome.sweep.spec.judge
    return ["", "## Judge", "",
            f"`{plan.args['pretrained']}` rated every generation for the concept {spec.concept!r} on AxBench's three 0–2 "
            f"scales (rubric: {spec.rubric or 'the shipped AxBench templates'}): `judge_concept` (the concept is present), "
            "`judge_instruction` (the text follows the prompt), `judge_fluency`; a rating is the judge's expected score "
            f"Σ k·p_k over its next-token probabilities of \"0\", \"1\", \"2\" right after the rubric prompt (which ends "
            f"{ANSWER!r}), normalized over the three; `judge_score`: their harmonic mean (0 if one is 0). Each is a mean "
            "over the prompts (and seeds) ± stderr; generations.jsonl holds every rating and its prompts "
            "(`judge`, `judge_prompts`). The Pareto plot puts each configuration's behaviour against its judge fluency."]  # fmt: skip


def _seeds(outcome) -> list[str]:
    sampled = [(name, ps.seeds) for name, (ps, _) in outcome.sweep.prompt_sets.items() if ps.seeds]
    return [f"- prompt set `{name}`: {len(seeds)} samples per prompt (seeds {', '.join(map(str, seeds))}); its generation "
            "metrics and judge ratings are means over prompts and seeds" for name, seeds in sampled]  # fmt: skip


def summary_lines(outcome) -> list[str]:
    """summary.md's sections on the prompting baselines and the judge, and a line per prompt set sampled per seed."""
    seeds = _seeds(outcome)
    return _prompting(outcome) + _judge(outcome) + (["", "## Repeated samples", "", *seeds] if seeds else [])


def judge_facts(outcome) -> dict | None:
    """run.json's `judge`: the model, concept, rubric folder and what its executor did."""
    plan, info = outcome.sweep.judge, outcome.info.get("judge") or {}
    if plan is None:
        return None
    spec = outcome.sweep.spec.judge
    computed = dict(info.get("requests_computed") or {})
    return {"model": plan.args["pretrained"], "concept": spec.concept, "rubric": spec.rubric or str(SHIPPED),
            "workers": info.get("workers"), "requests_computed": sum(computed.values()),
            "requests_cached": info.get("requests_cached", 0), "scoring_s": info.get("seconds"),
            "prefix_store": info.get("prefix_store", [])}  # fmt: skip
