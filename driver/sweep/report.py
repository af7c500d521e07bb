"""A sweep's outputs: tidy tables, generations, lm-eval's JSON per configuration, plots and summary.md.

Everything is written atomically (a temp file in the same folder, then a rename), so a reader never sees a
half-written file, and an interrupted sweep leaves the previous outputs (or none) in place.

Files in the output folder:
    results.jsonl, results.csv   one row per configuration × metric (COLUMNS)
    generations.jsonl            one row per configuration × prompt of a prompt set
    lm-eval/<config>.json        lm-eval's results for that configuration
    plots/heatmap-<task>-<metric>.png, plots/lines-<task>-<metric>.png   (driver.sweep.plots)
    summary.md, run.json         the grid, the baseline, the best and largest changes, failed and degenerate
                                 configurations, the run's facts

JSON output is strict JSON: a non-finite number is written as null (results rows hold None and an `error`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from driver.sweep import fluency
from driver.sweep import outdir
from driver.lm.evaluation import on_workers
from driver.sweep.plots import BASELINE, DPI, by_metric, facets, heatmap, heatmap_size, lines, lines_size, unit
from driver.sweep.plots import _fmt
from driver.sweep.rows import failures

__all__ = ["COLUMNS", "DPI", "heatmap_size", "lines_size", "unit", "write_outputs", "read_csv", "run_facts", "problems", "slug"]

COLUMNS = ("config", "vector", "layer", "site", "op", "positions", "alpha", "task", "metric", "value", "stderr", "n", "delta",
           "fluent", "error")  # fmt: skip

# --- atomic files ---------------------------------------------------------------------------------------------


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` to `path` through a temp file in the same folder and os.replace (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _json_default(obj: Any) -> Any:
    from lm_eval.utils import handle_non_serializable

    return handle_non_serializable(obj)


def strict(obj: Any) -> Any:
    """`obj` with every NaN/inf float as None (null): what JSON can hold."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def _json(obj: Any, **kw: Any) -> str:
    """Valid JSON (never a bare NaN or Infinity): non-finite numbers become null."""
    plain = json.loads(json.dumps(obj, default=_json_default))  # lm-eval's objects (numpy, sets) as JSON values
    return json.dumps(strict(plain), allow_nan=False, ensure_ascii=False, **kw)


def _jsonl(rows: Iterable[dict]) -> str:
    return "".join(_json(r) + "\n" for r in rows)


def _csv(rows: Sequence[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if strict(r.get(k)) is None else r[k]) for k in COLUMNS})
    return out.getvalue()


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("_") or "x"


# --- summary -------------------------------------------------------------------------------------------------


def _config_label(r: dict) -> str:
    if r["config"] == BASELINE:
        return "baseline"
    alpha = "" if r["alpha"] is None else f" α={r['alpha']:g}"
    return f"{r['vector']} L{r['layer']} {r['site']} {r['op']}{alpha} ({r['positions']})"


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


def run_facts(info: dict, seconds: float) -> dict:
    computed = dict(info.get("requests_computed") or {})
    return {
        "address": info.get("address"),
        "workers": info.get("workers"),
        "nodes": info.get("nodes"),
        "wall_s": round(seconds, 3),
        "scoring_s": info.get("seconds"),
        "requests_computed": sum(computed.values()),
        "requests_cached": info.get("requests_cached", 0),
        "per_worker": {n: {"requests": k, "requests_per_s": (info.get("requests_per_s") or {}).get(n)} for n, k in sorted(computed.items())},
        "cache": info.get("cache"),
    }


def _per_metric(outcome, metrics: dict) -> list[str]:
    out = ["", "## Per metric", "",
           "Best: the best value among configurations whose generations stay fluent (see Fluency).", "",
           "| task | metric | baseline | best configuration | its value | largest change from baseline | change |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (task, metric), mrows in metrics.items():
        hib = outcome.higher_is_better.get((task, metric))
        best, largest = extremes(mrows, hib)
        b = next((r for r in mrows if r["config"] == BASELINE), None)
        which = "lowest" if hib is False else "highest"
        out.append(
            f"| {task} | {metric} | {_num(b['value']) if b else '–'} | "
            f"{_config_label(best) + f' ({which})' if best else '–'} | {_num(best['value']) if best else '–'} | "
            f"{_config_label(largest) if largest else '–'} | {_fmt(largest['delta']) if largest else '–'} |"
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
    empty = {g["config"]: 0 for g in generations}
    for g in generations:
        empty[g["config"]] += g["empty"]
    out = ["", "## Fluency", "",
           f"The unsteered model's log-likelihood per token of each generated text (`fluency_logprob`) and the share of "
           f"its word {fluency.NGRAM}-grams that repeat (`repetition_rate`). A configuration is **not fluent** when, on "
           f"some prompt set, its mean `fluency_logprob` is more than {fluency.LOGPROB_MARGIN:g} nats/token below the "
           f"baseline's own generations, its `repetition_rate` more than {fluency.REPETITION_MARGIN:g} above the "
           f"baseline's, or more than {fluency.EMPTY_MARGIN:.0%} more of its generations are empty. Those are left out "
           "of \"best\", hatched in the heatmaps and crossed out in the line plots.", ""]  # fmt: skip
    if not bad:
        return out + ["Every configuration's generations stay fluent."]
    out += [f"{len(bad)} of {len(labels) - 1} configurations are not fluent:", "", "| configuration | empty generations |", "|---|---|"]
    return out + [f"| {labels[c]} | {empty.get(c, 0)} |" for c in bad]


def summary_md(outcome, plots: dict[tuple[str, str], tuple[str, str]]) -> str:
    sweep, rows = outcome.sweep, outcome.rows
    spec, facts = sweep.spec, run_facts(outcome.info, outcome.seconds)
    g = spec.grid
    grid = sweep.grid
    layers = sorted({c.layer for c in grid})
    alphas = sorted({c.alpha for c in grid if c.alpha is not None})
    vectors = sorted({c.vector for c in grid})
    lines_: list[str] = [
        f"# Steering sweep: {sweep.path.name}",
        "",
        f"Model `{sweep.model_args['pretrained']}` ({sweep.n_layers} layers) · {len(grid)} configurations + the baseline · "
        f"{on_workers(facts)} · wall time {facts['wall_s']:.1f} s",
        "",
        "## The grid",
        "",
        "| vectors | sites | layers | ops | positions | alphas |",
        "|---|---|---|---|---|---|",
        f"| {', '.join(vectors)} | {', '.join(g.sites)} | {', '.join(map(str, layers))} | {', '.join(g.ops)} | "
        f"{', '.join(g.positions)} | {', '.join(f'{a:g}' for a in alphas) or '–'} |",
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
    lines_ += _per_metric(outcome, metrics) + _failed(rows) + _fluency(rows, outcome.generations)
    if plots:
        lines_ += ["", "## Plots", ""]
        for (task, metric), (heat, line) in plots.items():
            lines_ += [f"### {task} · {metric}", "", f"![heatmap of {task} {metric}]({heat})", "", f"![{task} {metric} against alpha]({line})", ""]
    lines_ += ["", "## Run", "",
               f"- {on_workers(facts, ray=True)}",
               f"- wall time {facts['wall_s']:.1f} s; scoring time on the workers {facts['scoring_s'] or 0:.1f} s",
               f"- requests computed in this run: {facts['requests_computed']}; served from the cache: {facts['requests_cached']} "
               f"(cache: `{facts['cache']}`)",
               "", "| worker | requests | requests/s |", "|---|---|---|"]  # fmt: skip
    for name, w in facts["per_worker"].items():
        lines_.append(f"| {name} | {w['requests']} | {w['requests_per_s'] if w['requests_per_s'] is not None else '–'} |")
    return "\n".join(lines_) + "\n"


# --- everything -----------------------------------------------------------------------------------------------


def write_outputs(outcome, folder: str | os.PathLike) -> dict[str, Any]:
    """Write every output of a finished sweep into `folder`, then remove the outputs of an earlier sweep there that
    this one did not write (its other plots and configurations; never the cache); returns {what: path(s)}."""
    folder = Path(folder)
    rows = outcome.rows
    written: dict[str, Any] = {}
    files = set()
    for config_id, results in outcome.lm_eval.items():
        files.add(write_atomic(folder / "lm-eval" / f"{slug(config_id)}.json", _json(results, indent=2)))
    plots: dict[tuple[str, str], tuple[str, str]] = {}
    for (task, metric), mrows in by_metric(rows).items():
        if not facets(mrows):
            continue
        name = f"{slug(task)}-{slug(metric)}.png"
        files.add(write_atomic(folder / "plots" / f"heatmap-{name}", heatmap(task, metric, mrows)))
        files.add(write_atomic(folder / "plots" / f"lines-{name}", lines(task, metric, mrows)))
        plots[(task, metric)] = (f"plots/heatmap-{name}", f"plots/lines-{name}")
    written["plots"] = plots
    written["generations"] = write_atomic(folder / "generations.jsonl", _jsonl(outcome.generations))
    facts = {**run_facts(outcome.info, outcome.seconds), "sweep": str(outcome.sweep.path.absolute()),
             "configurations": [{**c.fields, "steering_key": c.steering.key()} for c in outcome.sweep.configs],
             "failed": failures(rows), "not_fluent": sorted({r["config"] for r in rows if r.get("fluent") is False}),
             "metrics": [list(k) for k in by_metric(rows)], "worker_facts": outcome.info.get("facts")}  # fmt: skip
    written["run"] = write_atomic(folder / "run.json", _json(facts, indent=2))
    written["summary"] = write_atomic(folder / "summary.md", summary_md(outcome, plots))
    written["csv"] = write_atomic(folder / "results.csv", _csv(rows))
    written["jsonl"] = write_atomic(folder / "results.jsonl", _jsonl({k: r.get(k) for k in COLUMNS} for r in rows))
    files |= {written[k] for k in ("generations", "run", "summary", "csv", "jsonl")}
    written["removed"] = outdir.remove_stale(folder, files)
    return written


def read_csv(path: str | os.PathLike) -> list[dict]:
    """results.csv back as dicts of typed values (for tests and notebooks)."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row: dict[str, Any] = {k: (v if v != "" else None) for k, v in r.items()}
            for k in ("value", "stderr", "delta", "alpha"):
                row[k] = float(r[k]) if r[k] != "" else None
            for k in ("layer", "n"):
                row[k] = int(r[k]) if r[k] != "" else None
            row["fluent"] = {"True": True, "False": False}.get(r.get("fluent") or "")
            out.append(row)
    return out



def problems(rows: Sequence[dict], written: dict) -> list[str]:
    """One line each, for the terminal: failed and degenerate configurations, and a previous sweep's outputs removed."""
    out = []
    failed = failures(rows)
    if failed:
        first, why = next(iter(failed.items()))
        out.append(f"warning: {len(failed)} configuration(s) failed with a non-finite score (e.g. {first}: {why}); see summary.md")
    bad = {r["config"] for r in rows if r.get("fluent") is False}
    if bad:
        out.append(f"note: {len(bad)} configuration(s) generate text that is not fluent; \"best\" leaves them out (summary.md, Fluency)")
    if written.get("removed"):
        out.append(f"note: removed {len(written['removed'])} output file(s) of an earlier sweep in this folder (the cache stays)")
    return out
