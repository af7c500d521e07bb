"""A sweep's summary.md: the grid, the baseline, the best and largest changes, failed and not fluent configurations."""

from __future__ import annotations

import math
from collections.abc import Sequence

from driver.lm.evaluation import on_workers
from driver.sweep import fluency
from driver.sweep.plots import by_metric, signed
from driver.sweep.rows import BASELINE, FIRED, failures

__all__ = ["summary_md", "extremes", "condition_facts"]


def _config_label(r: dict) -> str:
    if r["config"] == BASELINE:
        return "baseline"
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


def _per_metric(outcome, metrics: dict) -> list[str]:
    out = ["", "## Per metric", "",
           "Best: the best value among configurations whose generations stay fluent (see Fluency).", "",
           "| task | metric | baseline | best configuration | its value | largest change from baseline | change |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (task, metric), mrows in metrics.items():
        if metric == FIRED:  # not a score: the Condition section
            continue
        hib = outcome.higher_is_better.get((task, metric))
        best, largest = extremes(mrows, hib)
        b = next((r for r in mrows if r["config"] == BASELINE), None)
        which = "lowest" if hib is False else "highest"
        out.append(
            f"| {task} | {metric} | {_num(b['value']) if b else '–'} | "
            f"{_config_label(best) + f' ({which})' if best else '–'} | {_num(best['value']) if best else '–'} | "
            f"{_config_label(largest) if largest else '–'} | {signed(largest['delta']) if largest else '–'} |"
        )
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


_ALT = {"heatmap": "heatmap of {}", "lines": "{} against alpha", "heads": "layers × heads heatmap of {}"}


def _plots(plots: dict[tuple[str, str], list[str]]) -> list[str]:
    """Each metric's plots (report: plots/heatmap-, lines-, heads-<task>-<metric>.png)."""
    out = ["", "## Plots", ""] if plots else []
    for (task, metric), paths in plots.items():
        out += [f"### {task} · {metric}", ""]
        for path in paths:
            alt = _ALT[path.rsplit("/", 1)[-1].split("-", 1)[0]].format(f"{task} {metric}")
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


def summary_md(outcome, plots: dict[tuple[str, str], list[str]], facts: dict) -> str:
    """summary.md of a finished sweep, given its plots' paths and the run's facts (`report.run_facts`)."""
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
    lines_ += _top(sweep.top_features) + _per_metric(outcome, metrics) + _condition(facts.get("condition"))
    lines_ += _failed(rows) + _fluency(rows, outcome.generations)
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
