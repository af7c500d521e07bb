"""A sweep's summary.md: the grid, the baseline, the best and largest changes, failed and not fluent configurations."""

from __future__ import annotations

import math
from collections.abc import Sequence

from driver.lm.evaluation import on_workers
from driver.judge import compare as evidence_configs
from driver.sweep import fluency
from driver.sweep.plots import by_metric, signed
from driver.sweep.rows import BASELINE, FIRED, failures

__all__ = ["summary_md", "extremes", "condition_facts"]


def _config_label(r: dict) -> str:
    if r["config"] == BASELINE or r.get("op") == "prompt":  # a prompting baseline: prompt:NAME
        return "baseline" if r["config"] == BASELINE else r["config"]
    alpha = "" if r["alpha"] is None else f" α={r['alpha']:g}"
    head = "" if r.get("head") is None else f" head {r['head']}"
    threshold = "" if r.get("threshold") is None else f" t={r['threshold']:g}"
    return f"{r['vector']} L{r['layer']} {r['site']}{head} {r['op']}{alpha}{threshold} ({r['positions']})"


def _num(v: float | None, digits: int = 4) -> str:
    return "–" if v is None else f"{v:.{digits}g}"


def extremes(rows: Sequence[dict], higher_is_better: bool | None) -> tuple[dict | None, dict | None]:
    """(best configuration, largest change from baseline) among the non-baseline rows of one metric with a value;
    the best only among configurations whose generations stay fluent (`fluent` not False)."""
    grid = [r for r in rows if r["config"] != BASELINE and r["value"] is not None and math.isfinite(r["value"])]
    if not grid:
        return None, None
    sign = -1.0 if higher_is_better is False else 1.0
    best = max((r for r in grid if r.get("fluent") is not False), key=lambda r: sign * r["value"], default=None)
    largest = max((r for r in grid if r["delta"] is not None), key=lambda r: abs(r["delta"]), default=None)
    return best, largest


def _interval(r: dict) -> str:
    """'+0.12 [-0.03, +0.27]': a change and its paired 95 % interval ('+0.12' without one)."""
    if r.get("delta_low") is None:
        return signed(r["delta"])
    return f"{signed(r['delta'])} [{signed(r['delta_low'])}, {signed(r['delta_high'])}]"


def _beyond(r: dict, side: float = 0.0) -> bool:
    """The row's interval excludes 0 (side 0), or lies wholly above it (side 1) or below it (side -1)."""
    lo, hi = r.get("delta_low"), r.get("delta_high")
    if lo is None or hi is None:
        return False
    return lo > 0 if side > 0 else hi < 0 if side < 0 else (lo > 0 or hi < 0)


NOISE = "no configuration differs from the baseline beyond noise"
NO_GAIN = "no configuration improves on the baseline beyond noise"
NO_INTERVAL = "no interval (no per-sample values of this metric)"


def named(rows: Sequence[dict], higher_is_better: bool | None) -> tuple[dict | str | None, dict | str | None]:
    """(best, largest change) as summary.md names them: `extremes` among steering configurations (prompting
    baselines are reported beside them) whose paired 95 % interval excludes 0 (the best's on its better side); a
    sentence instead where none does, or where the metric has no interval; None where nothing has a value."""
    steering = [r for r in rows if r.get("op") != "prompt"]
    grid = [r for r in steering if r["config"] != BASELINE and r["value"] is not None]
    if not grid:
        return None, None
    if all(r.get("delta_low") is None for r in grid):
        return NO_INTERVAL, NO_INTERVAL
    side = -1.0 if higher_is_better is False else 1.0
    best = extremes([r for r in steering if r["config"] == BASELINE or _beyond(r, side)], higher_is_better)[0]
    largest = extremes([r for r in steering if r["config"] == BASELINE or _beyond(r)], higher_is_better)[1]
    if largest is None:
        return NOISE, NOISE
    if higher_is_better is None:  # no better side: only the largest change
        return None, largest
    return best if best is not None else NO_GAIN, largest


def _cells(found: dict | str | None, suffix: str = "") -> tuple[str, str]:
    if isinstance(found, dict):
        return _config_label(found) + suffix, _interval(found)
    return found or "–", "–"


def _per_metric(outcome, metrics: dict, held_out: bool) -> list[str]:
    where = ("chosen and reported on the same samples: see Held-out selection for a best chosen on one part of the "
             "samples and reported on the other") if held_out else (
             "chosen and reported on the same samples (the file has no `select:`), so its value is biased upward")  # fmt: skip
    out = ["", "## Per metric", "",
           "Best: the best value among steering configurations whose generations stay fluent (see Fluency) and whose "
           "change from the baseline is beyond noise: its paired 95 % interval (over the same samples; Student's t) "
           f"lies wholly on the better side of 0; {where}. Largest change: the largest |change| whose interval "
           "excludes 0. Changes read `change [95 % interval]`.", "",
           "| task | metric | baseline | best configuration | its value | its change | largest change from baseline | change |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (task, metric), mrows in metrics.items():
        if metric == FIRED:  # not a score: the Condition section
            continue
        hib = outcome.higher_is_better.get((task, metric))
        best, largest = named(mrows, hib)
        b = next((r for r in mrows if r["config"] == BASELINE), None)
        which = " (lowest)" if hib is False else " (highest)"
        (best_label, best_change), (largest_label, largest_change) = _cells(best, which), _cells(largest)
        value = _num(best["value"]) if isinstance(best, dict) else "–"
        out.append(f"| {task} | {metric} | {_num(b['value']) if b else '–'} | {best_label} | {value} | {best_change} | "
                   f"{largest_label} | {largest_change} |")  # fmt: skip
    return out


def _labels(rows: Sequence[dict]) -> dict[str, str]:
    return {r["config"]: _config_label(r) for r in rows}


def _failed(rows: Sequence[dict]) -> list[str]:
    """The configurations with a non-finite score: their cells hold no number (results: `error`)."""
    failed = failures(rows)
    if not failed:
        return []
    labels = _labels(rows)
    out = ["", "## Failed configurations", "",
           f"{len(failed)} configuration(s) gave a non-finite score; their cells have no value (see `error` in results.csv):",
           "", "| configuration | what failed |", "|---|---|"]  # fmt: skip
    return out + [f"| {labels[c]} | {why} |" for c, why in failed.items()]


def _fluency(rows: Sequence[dict], generations: Sequence[dict]) -> list[str]:
    """Which configurations' generations are degenerate, and the rule."""
    if not generations:
        return []
    labels = _labels(rows)
    bad = sorted({r["config"] for r in rows if r.get("fluent") is False}, key=list(labels).index)
    why = fluency.why_not(rows, generations)
    out = ["", "## Fluency", "",
           f"The unsteered model's log-likelihood per token of each generated text (`fluency_logprob`) and the share of "
           f"its word {fluency.NGRAM}-grams that repeat (`repetition_rate`). A configuration is **not fluent** when, on "
           f"some prompt set, its mean `fluency_logprob` is more than {fluency.LOGPROB_MARGIN:g} nats/token below the "
           f"baseline's own generations, its `repetition_rate` more than {fluency.REPETITION_MARGIN:g} above the "
           f"baseline's, or more than {fluency.EMPTY_MARGIN:.0%} more of its generations are empty. Those are left out "
           "of \"best\", hatched in the heatmaps and crossed out in the line plots.", ""]  # fmt: skip
    if not bad:
        return out + ["Every configuration's generations stay fluent."]
    out += [f"{len(bad)} of {len(labels) - 1} configurations are not fluent:", "", "| configuration | why (prompt set: measure, value, threshold) |", "|---|---|"]
    return out + [f"| {labels[c]} | {'; '.join(why.get(c, ['?']))} |" for c in bad]


_ALT = {"heatmap": "heatmap of {}", "lines": "{} against alpha", "heads": "layers × heads heatmap of {}",
        "steerability": "per-sample steerability on {}", "pareto": "Pareto plot of {}"}


def _plots(plots: dict[tuple[str, str], list[str]]) -> list[str]:
    """Each metric's plots (report: plots/heatmap-, lines-, heads-<task>-<metric>.png)."""
    out = ["", "## Plots", ""] if plots else []
    for (task, metric), paths in plots.items():
        out += [f"### {task} · {metric}", ""]
        for path in paths:
            kind = path.rsplit("/", 1)[-1].split("-", 1)[0]
            alt = _ALT[kind].format(task if kind == "steerability" else f"{task} {metric}")
            out += [f"![{alt}]({path})", ""]
    return out


def condition_facts(sweep, rows: Sequence[dict]) -> dict:
    """The file's condition, its thresholds, and per (threshold, task) the share of rows fired: min and max over the
    configurations at that threshold (the decision reads the prompt only, so they differ only where steering at or
    below a condition layer moves what it reads)."""
    rates: dict[tuple, list[float]] = {}
    for r in rows:
        if r["metric"] == FIRED and r["value"] is not None:
            rates.setdefault((r["threshold"], r["task"]), []).append(r["value"])
    fired = [{"threshold": t, "task": task, "min": min(v), "max": max(v), "configurations": len(v)} for (t, task), v in rates.items()]
    return {**sweep.spec.condition.model_dump(mode="json"), "thresholds": list(sweep.spec.grid.thresholds), "fired": fired}


def _vector_text(v) -> str:
    """A vector as the file wrote it: a path, `file` (key), or feature N of an SAE."""
    if isinstance(v, dict) and "sae" in v:
        return f"feature {v['feature']} of the SAE {v['sae']}"
    return f"{v['file']}" + (f" ({v['key']})" if v.get("key") else "") if isinstance(v, dict) else str(v)


def _condition(facts: dict | None) -> list[str]:
    if not facts:
        return []
    sign = ">" if facts["compare"] == "greater" else "<"
    out = ["", "## Condition", "",
           f"Every configuration steers only the rows whose prompt passes CAST's condition: cos(h, tanh(P h)) {sign} the "
           f"threshold, h the {facts['pool']} of the prompt's input of layer(s) {', '.join(map(str, facts['layers']))}, P the "
           f"projector on {_vector_text(facts['vector'])}. `fired` (results.csv) is each configuration's share of rows steered; here "
           "per threshold and task, its range over the configurations:", "",
           "| threshold | task | fired | configurations |", "|---|---|---|---|"]  # fmt: skip
    for f in facts["fired"]:
        share = f"{f['min']:.0%}" if f["min"] == f["max"] else f"{f['min']:.0%}–{f['max']:.0%}"
        out.append(f"| {f['threshold']:g} | {f['task']} | {share} | {f['configurations']} |")
    return out


def _top(top_features: Sequence[dict]) -> list[str]:
    if not top_features:
        return []
    out = ["", "## Top features", "",
           "The features each `top` source swept: the SAE's K highest by mean activation (its encoder) over its prompts' "
           "tokens (every token but a leading BOS, each prompt weighing the same), captured at the SAE's site:", "",
           "| vector | site | layer | prompts | feature | mean activation |", "|---|---|---|---|---|---|"]  # fmt: skip
    for t in top_features:
        where = f"| {t['vector']} | {t['site']} | {t['layer']} | {t['prompts'].rsplit('/', 1)[-1]} ({t['n_prompts']}, {t['tokens']} tokens)"
        out += [f"{where} | {f['feature']} | {f['mean_activation']:.4g} |" for f in t["features"]]
    return out


def _family_label(r: dict) -> str:
    head = "" if r.get("head") is None else f" head {r['head']}"
    threshold = "" if r.get("threshold") is None else f" t={r['threshold']:g}"
    return f"{r['vector']} L{r['layer']} {r['site']}{head} {r['op']}{threshold} ({r['positions']})"


def _steerability(rows: Sequence[dict]) -> list[str]:
    """The steerability table (steerability.csv): per family and source, the mean per-sample slope and its spread."""
    if not rows:
        return []
    out = ["", "## Steerability", "",
           "Each sample's least-squares slope of its behaviour score (`logprob_diff`: positive − negative targets; "
           "`p_gold`: a multiple-choice task's gold probability over its choices) against alpha, over every alpha of "
           "the family and the baseline's 0 (add, replace); `slope`: their mean ± stderr over samples; anti-steerable: "
           "the share of samples whose slope is < 0 (they move the wrong way); Spearman: the mean per-sample rank "
           "correlation of alpha and the score (steerability.csv; plots/steerability-<source>.png).", "",
           "| source | metric | family | slope | anti-steerable | Spearman | n |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        spread = f" ± {r['slope_stderr']:.2g}" if r["slope_stderr"] is not None else ""
        rho = "–" if r["spearman"] is None else f"{r['spearman']:+.2f}"
        out.append(f"| {r['source']} | {r['metric']} | {_family_label(r)} | {r['slope']:+.3g}{spread} | {r['anti_steerable']:.0%} | {rho} | {r['n']} |")
    return out


def _reported(entry: dict) -> str:
    """'0.51 ± 0.04 (change +0.12 [+0.03, +0.21])': a chosen configuration on the report part."""
    change = entry["report_change"]
    interval = "" if change is None else f" [{signed(change['low'])}, {signed(change['high'])}]"
    value = _num(entry["report_value"]) + (f" ± {entry['report_stderr']:.2g}" if entry["report_stderr"] is not None else "")
    return f"{value} (change {signed(change['mean']) if change else '–'}{interval})"


def _picked(entry: dict | None, labels: dict[str, str]) -> str:
    return "–" if entry is None else f"{labels.get(entry['config'], entry['config'])}: {_reported(entry)}"


def _selection(evidence, rows: Sequence[dict]) -> list[str]:
    """Which part of the samples chose the best steering configuration and which reported it, per (source, metric),
    with the best prompting baseline beside it."""
    if evidence is None or not evidence.selection:
        return []
    labels = _labels(rows)
    if evidence.held_out:
        sel = evidence.select
        parts = "; ".join(f"{s}: {c.get('select', 0)} select, {c.get('report', 0)} report" for s, c in evidence.counts.items())
        head = (f"Each source's samples are split by `select: {{fraction: {sel['fraction']:g}, seed: {sel['seed']}}}` ({parts}). "
                "The best steering configuration is **chosen on the select part** and its value **reported on the report part**, "
                "with the paired 95 % interval of its change from the baseline on the report part.")  # fmt: skip
    else:
        head = ("No `select:` in the file: the best steering configuration was **chosen and reported on the same samples**, "
                "so its value is biased upward (add `select: {fraction: 0.5, seed: 0}` to choose on one part and report on "
                "the other).")  # fmt: skip
    out = ["", "## Held-out selection", "", head, "",
           "| source | metric | chosen on select (its value, n) | reported (value ± stderr, change [95 % interval]) | n report | beyond noise | best prompting baseline (reported) |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for e in evidence.selection:
        change = e["report_change"]
        verdict = "–" if change is None else "yes" if change["low"] > 0 or change["high"] < 0 else "no"
        out.append(f"| {e['source']} | {e['metric']} | {labels.get(e['config'], e['config'])} ({_num(e['select_value'])}, {e['n_select']}) | "
                   f"{_reported(e)} | {e['n_report']} | {verdict} | {_picked(e.get('prompting'), labels)} |")  # fmt: skip
    return out


def _unsteered(rows: Sequence[dict], metrics: dict) -> list[str]:
    """Baseline lines of metrics measured against their own unsteered value (an SAE feature's activation, per
    feature and place): value − delta of its configurations."""
    out, seen = [], set()
    for (task, metric), mrows in metrics.items():
        if any(r["config"] == BASELINE for r in mrows):
            continue
        for r in mrows:
            key = (task, metric, r["vector"], r["site"], r["layer"])
            if r["value"] is not None and r.get("delta") is not None and key not in seen:
                seen.add(key)
                out.append(f"| {task} | {metric} ({r['vector']} at L{r['layer']} {r['site']}, unsteered) | {_num(r['value'] - r['delta'])} | – | {r['n']} |")
    return out


def summary_md(outcome, plots: dict[tuple[str, str], list[str]], facts: dict, evidence=None) -> str:
    """summary.md of a finished sweep, given its plots' paths, the run's facts (`report.run_facts`) and its evidence
    (driver.evidence.analysis.Evidence: steerability, selection)."""
    sweep, rows = outcome.sweep, outcome.rows
    spec = sweep.spec
    g = spec.grid
    grid = sweep.grid
    layers = sorted({c.layer for c in grid})
    alphas = sorted({c.alpha for c in grid if c.alpha is not None})
    vectors = sorted({c.vector for c in grid})
    heads = sorted({c.head for c in grid if c.head is not None})
    lines_: list[str] = [
        f"# Steering sweep: {sweep.path.name}",
        "",
        f"Model `{sweep.model_args['pretrained']}` ({sweep.n_layers} layers) · {len(grid)} configurations + the baseline · "
        f"{on_workers(facts)} · wall time {facts['wall_s']:.1f} s",
        "",
        "## The grid",
        "",
        "| vectors | sites | heads | layers | ops | positions | alphas |" + (" thresholds |" if g.thresholds else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if g.thresholds else ""),
        f"| {', '.join(vectors)} | {', '.join(g.sites)} | {', '.join(map(str, heads)) or '–'} | {', '.join(map(str, layers))} | "
        f"{', '.join(g.ops)} | {', '.join(g.positions)} | {', '.join(f'{a:g}' for a in alphas) or '–'} |"
        + (f" {', '.join(f'{t:g}' for t in g.thresholds)} |" if g.thresholds else ""),
        "",
        "Alpha 0 is the baseline (the unsteered model), computed once for the whole grid.",
        "",
        "Evaluated on:",
        "",
    ]
    if spec.tasks is not None:
        t = spec.tasks
        lines_.append(f"- lm-eval tasks {', '.join(t.names)} (limit {t.limit if t.limit is not None else 'none'}, "
                      f"num_fewshot {t.num_fewshot if t.num_fewshot is not None else 'task default'})")  # fmt: skip
    for name, (ps, prompts) in sweep.prompt_sets.items():
        with_targets = sum(1 for p in prompts if p.targets)
        gen = f"{'sampled (temperature ' + format(ps.temperature, 'g') + ', seed ' + str(ps.seed) + ')' if ps.temperature > 0 else 'greedy'} generations of up to {ps.max_gen_toks} tokens" if ps.generate else "no generations"
        lines_.append(f"- prompt set `{name}` ({ps.file}): {len(prompts)} prompts, {with_targets} with targets; {gen}")
    metrics = by_metric(rows)
    lines_ += ["", "## Baseline", "", "| task | metric | value | stderr | n |", "|---|---|---|---|---|"]
    for (task, metric), mrows in metrics.items():
        b = next((r for r in mrows if r["config"] == BASELINE), None)
        if b is not None:
            lines_.append(f"| {task} | {metric} | {_num(b['value'])} | {_num(b['stderr'], 3)} | {b['n'] if b['n'] is not None else '–'} |")
    lines_ += _unsteered(rows, metrics)
    held_out = evidence is not None and evidence.held_out
    lines_ += _top(sweep.top_features) + _per_metric(outcome, metrics, held_out) + _selection(evidence, rows)
    lines_ += _steerability(evidence.steerability if evidence is not None else []) + _condition(facts.get("condition"))
    lines_ += _failed(rows) + _fluency(rows, outcome.generations) + evidence_configs.summary_lines(outcome)  # driver.judge
    lines_ += _plots(plots)
    lines_ += ["", "## Run", "",
               f"- {on_workers(facts, ray=True)}",
               f"- wall time {facts['wall_s']:.1f} s; scoring time on the workers {facts['scoring_s'] or 0:.1f} s",
               f"- requests computed in this run: {facts['requests_computed']}; served from the cache: {facts['requests_cached']} "
               f"(cache: `{facts['cache']}`)",
               "", "| worker | requests | requests/s |", "|---|---|---|"]  # fmt: skip
    for name, w in facts["per_worker"].items():
        why = f" ({w['why_none']})" if "why_none" in w else " (lost)" if w.get("lost") else ""
        lines_.append(f"| {name} | {w['requests']}{why} | {w['requests_per_s'] if w['requests_per_s'] is not None else '–'} |")
    return "\n".join(lines_) + "\n"
