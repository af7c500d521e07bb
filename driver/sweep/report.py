"""A sweep's outputs written into its folder: the tables, generations, lm-eval's JSON, plots and summary.md.

The plots are drawn by driver.sweep.plots and summary.md by driver.sweep.summary. Everything is written through
a temp file in the same folder and a rename, so a reader never sees a half-written file, and an interrupted sweep
leaves the previous outputs (or none) in place.

Files in the output folder:
    results.jsonl, results.csv   one row per configuration × metric (COLUMNS)
    generations.jsonl            one row per configuration × prompt of a prompt set
    samples.jsonl                one row per configuration × source × sample (driver.evidence.records)
    steerability.csv             one row per steering family × source (driver.evidence.steerability.COLUMNS)
    plots/steerability-<source>.png   each layer's per-sample slopes (driver.evidence.draw)
    lm-eval/<config>.json        lm-eval's results for that configuration
    plots/heatmap-<task>-<metric>.png, plots/lines-<task>-<metric>.png   (driver.sweep.plots; sites without heads)
    plots/heads-<task>-<metric>.png    layers × heads, per alpha (head sites: attn_head)
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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from driver.checks.files import write_atomic
from driver.lm.evaluation import per_worker
from driver.evidence import draw
from driver.evidence.analysis import analyse
from driver.evidence.steerability import COLUMNS as STEERABILITY
from driver.judge.compare import judge_facts
from driver.judge.pareto import pareto_plots
from driver.sweep import outdir
from driver.sweep.plots import HEADS, by_metric, facets, heatmap, lines
from driver.sweep.rows import FIRED, failures
from driver.sweep.summary import condition_facts, summary_md

__all__ = ["COLUMNS", "write_outputs", "read_csv", "run_facts", "problems", "slug"]

COLUMNS = ("config", "vector", "layer", "site", "head", "op", "positions", "alpha", "threshold", "task", "metric", "value", "stderr", "n",
           "delta", "delta_low", "delta_high", "fluent", "error")  # fmt: skip


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


def _csv(rows: Sequence[dict], columns: Sequence[str] = COLUMNS) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if strict(r.get(k)) is None else r[k]) for k in columns})
    return out.getvalue()


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("_") or "x"


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
        "per_worker": per_worker(info),  # every worker, idle ones included
        "cache": info.get("cache"),
        "prefix_store": info.get("prefix_store", []),  # per worker: hits, tokens reused, peak bytes vs budget, evictions
        **({"groups": info["groups"]} if "groups" in info else {}),  # worker groups: each rank's node, layers, peak memory
    }

# --- everything -----------------------------------------------------------------------------------------------


def write_outputs(outcome, folder: str | os.PathLike) -> dict[str, Any]:
    """Write every output of a finished sweep into `folder`, then remove the outputs of an earlier sweep there that
    this one did not write (its other plots and configurations; never the cache); returns {what: path(s)}."""
    folder = Path(folder)
    rows = outcome.rows
    evidence = analyse(outcome, outcome.sweep.spec.select)  # before the plots: they mute cells whose interval holds 0
    written: dict[str, Any] = {}
    files = set()
    for config_id, results in outcome.lm_eval.items():
        files.add(write_atomic(folder / "lm-eval" / f"{slug(config_id)}.json", _json(results, indent=2)))
    plots: dict[tuple[str, str], list[str]] = {}
    for (task, metric), mrows in by_metric(rows).items():
        if metric == FIRED:  # a share of rows, not a change from the baseline: summary.md's Condition table says it
            continue
        name = f"{slug(task)}-{slug(metric)}.png"
        drawn = []
        if facets(mrows):  # layers × alphas, sites without heads
            drawn += [(f"plots/heatmap-{name}", heatmap(task, metric, mrows)), (f"plots/lines-{name}", lines(task, metric, mrows))]
        if facets(mrows, HEADS):  # layers × heads, head sites
            drawn.append((f"plots/heads-{name}", heatmap(task, metric, mrows, HEADS)))
        for path, png in drawn:
            files.add(write_atomic(folder / path, png))
        if drawn:
            plots[(task, metric)] = [path for path, _ in drawn]
    for source, png in draw.steerability_plots(evidence.steerability).items():
        files.add(write_atomic(folder / f"plots/steerability-{slug(source)}.png", png))
        plots[(source, "steerability")] = [f"plots/steerability-{slug(source)}.png"]
    for source, (metric, png) in pareto_plots(rows).items():  # with a judge: behaviour against its fluency
        files.add(write_atomic(folder / f"plots/pareto-{slug(source)}.png", png))
        plots[(source, f"{metric} vs judge_fluency")] = [f"plots/pareto-{slug(source)}.png"]
    written["plots"] = plots
    written["samples"] = write_atomic(folder / "samples.jsonl", _jsonl(evidence.records))
    written["steerability"] = write_atomic(folder / "steerability.csv", _csv(evidence.steerability, STEERABILITY))
    written["generations"] = write_atomic(folder / "generations.jsonl", _jsonl(outcome.generations))
    facts = {**run_facts(outcome.info, outcome.seconds), "sweep": str(outcome.sweep.path.absolute()),
             "configurations": [{**c.fields, "steering_key": c.steering.key()} for c in outcome.sweep.configs],
             "failed": failures(rows), "not_fluent": sorted({r["config"] for r in rows if r.get("fluent") is False}),
             "metrics": [list(k) for k in by_metric(rows)], "worker_facts": outcome.info.get("facts"),
             "select": evidence.select, "selection": evidence.selection,
             **({"top_features": outcome.sweep.top_features} if outcome.sweep.top_features else {}),
             **({"judge": judge_facts(outcome)} if outcome.sweep.judge else {}),
             **({"condition": condition_facts(outcome.sweep, rows)} if outcome.sweep.spec.condition else {})}  # fmt: skip
    written["run"] = write_atomic(folder / "run.json", _json(facts, indent=2))
    written["summary"] = write_atomic(folder / "summary.md", summary_md(outcome, plots, facts, evidence))
    written["csv"] = write_atomic(folder / "results.csv", _csv(rows))
    written["jsonl"] = write_atomic(folder / "results.jsonl", _jsonl({k: r.get(k) for k in COLUMNS} for r in rows))
    files |= {written[k] for k in ("generations", "samples", "steerability", "run", "summary", "csv", "jsonl")}
    written["removed"] = outdir.remove_stale(folder, files)
    return written


def read_csv(path: str | os.PathLike) -> list[dict]:
    """results.csv back as dicts of typed values (for tests and notebooks)."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row: dict[str, Any] = {k: (v if v != "" else None) for k, v in r.items()}
            for k in ("value", "stderr", "delta", "delta_low", "delta_high", "alpha", "threshold"):
                row[k] = float(r[k]) if r.get(k) not in (None, "") else None
            for k in ("layer", "head", "n"):
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
