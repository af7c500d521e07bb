"""A sweep's outputs: tidy tables, generations, lm-eval's JSON per configuration, plots and summary.md.

Everything is written atomically (a temp file in the same folder, then a rename), so a reader never sees a
half-written file, and an interrupted sweep leaves the previous outputs (or none) in place.

Files in the output folder:
    results.jsonl, results.csv   one row per configuration × metric (COLUMNS)
    generations.jsonl            one row per configuration × prompt of a prompt set
    lm-eval/<config>.json        lm-eval's results for that configuration
    plots/heatmap-<task>-<metric>.png, plots/lines-<task>-<metric>.png
    summary.md, run.json         the grid, the baseline, the best and largest changes, the run's facts
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

from .evaluation import on_workers

COLUMNS = ("config", "vector", "layer", "site", "op", "positions", "alpha", "task", "metric", "value", "stderr", "n", "delta")
DPI = 100
BASELINE = "baseline"

_UNITS = {
    "logprob_diff": "nats",
    "p_positive": "probability",
    "acc": "fraction correct",
    "acc_norm": "fraction correct",
    "exact_match": "fraction",
    "word_perplexity": "perplexity",
    "byte_perplexity": "perplexity",
    "bits_per_byte": "bits/byte",
}


def unit(metric: str) -> str:
    base = metric.split(",")[0]
    if base.startswith("logprob_"):
        return "nats"
    return _UNITS.get(base, "")


def _with_unit(text: str, metric: str) -> str:
    u = unit(metric)
    return f"{text} ({u})" if u else text


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


def _jsonl(rows: Iterable[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, default=_json_default) + "\n" for r in rows)


def _csv(rows: Sequence[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if r.get(k) is None else r[k]) for k in COLUMNS})
    return out.getvalue()


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("_") or "x"


# --- shaping the rows for plots -------------------------------------------------------------------------------


def by_metric(rows: Sequence[dict]) -> dict[tuple[str, str], list[dict]]:
    """Rows grouped by (task, metric), in first-seen order."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        out.setdefault((r["task"], r["metric"]), []).append(r)
    return out


def facets(rows: Sequence[dict]) -> dict[tuple, list[dict]]:
    """Non-baseline rows of one metric grouped by (vector, site, op, positions): one heatmap panel each."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["config"] != BASELINE:
            out.setdefault((r["vector"], r["site"], r["op"], r["positions"]), []).append(r)
    return out


def panel_axes(rows: Sequence[dict]) -> tuple[list[int], list[float | None]]:
    """(layers, alphas) of one panel; add/replace panels get alpha 0, the baseline column."""
    layers = sorted({r["layer"] for r in rows})
    op = rows[0]["op"]
    if op == "ablate":
        return layers, [None]
    alphas = {float(r["alpha"]) for r in rows}
    if op in ("add", "replace"):
        alphas.add(0.0)
    return layers, sorted(alphas)


def _quarter(x: float) -> float:
    return math.ceil(x * 4) / 4  # whole pixels at DPI 100


MAX_COLUMNS = 3  # panels per row of a figure


def _panel_grid(n: int) -> tuple[int, int]:
    cols = min(MAX_COLUMNS, max(1, n))
    return cols, math.ceil(max(1, n) / cols)


def heatmap_size(n_layers: int, n_alphas: Sequence[int] | int) -> tuple[float, float]:
    """The heatmap figure's size in inches (pixels: × DPI) for panels of `n_alphas` columns each and at most
    `n_layers` rows, laid out MAX_COLUMNS panels to a row."""
    alphas = [n_alphas] if isinstance(n_alphas, int) else list(n_alphas)
    cols, rows = _panel_grid(len(alphas))
    panel = max(max(3.5, 1.25 + 0.8 * n) for n in alphas)
    return _quarter(cols * panel + 1.5), _quarter(rows * max(3.0, 1.75 + 0.5 * n_layers) + 0.5)


def lines_size(n_facets: int) -> tuple[float, float]:
    """The line plot's size in inches: 5.75 × 4.5 per panel, MAX_COLUMNS panels to a row."""
    cols, rows = _panel_grid(n_facets)
    return _quarter(5.75 * cols + 0.5), _quarter(4.5 * rows)


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if v == 0:
        return "0"
    a = abs(v)
    return f"{v:+.2f}" if 0.01 <= a < 100 else f"{v:+.2g}"


def _alpha_label(a: float | None) -> str:
    return "ablate" if a is None else f"{a:g}"


def _title(task: str, metric: str, baseline: dict | None) -> str:
    base = ""
    if baseline is not None:
        err = f" ± {baseline['stderr']:.3g}" if baseline.get("stderr") is not None else ""
        base = f"  (baseline {baseline['value']:.4g}{err})"
    return f"{task} · {metric}{base}"


def _facet_title(key: tuple) -> str:
    vector, site, op, positions = key
    return f"vector {vector} at {site}\n{op}, positions {positions}"


def heatmap(path: Path, task: str, metric: str, rows: Sequence[dict]) -> Path:
    """Layers × alphas of the change from the baseline, one panel per (vector, site, op, positions)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    baseline = next((r for r in rows if r["config"] == BASELINE), None)
    panels = facets(rows)
    shapes = [panel_axes(p) for p in panels.values()]
    n_layers = max(len(layers) for layers, _ in shapes)
    matrices = []
    for (layers, alphas), prows in zip(shapes, panels.values()):
        m = np.full((len(layers), len(alphas)), np.nan)
        for r in prows:
            a = None if r["op"] == "ablate" else float(r["alpha"])
            m[layers.index(r["layer"]), alphas.index(a)] = r["delta"] if r["delta"] is not None else np.nan
        if prows[0]["op"] in ("add", "replace") and baseline is not None:
            m[:, alphas.index(0.0)] = 0.0  # for add and replace, alpha 0 is the baseline
        matrices.append(m)
    finite = [abs(x) for m in matrices for x in m.ravel() if np.isfinite(x)]
    bound = max(finite + [0.0]) or 1e-12
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-bound, vmax=bound)
    cmap = plt.get_cmap("RdBu_r")
    cols, nrows = _panel_grid(len(panels))
    fig = plt.figure(figsize=heatmap_size(n_layers, [len(a) for _, a in shapes]), dpi=DPI, layout="constrained")
    grid = fig.subplots(nrows, cols, squeeze=False)
    axes = list(grid.ravel())
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    image = None
    for ax, key, (layers, alphas), m in zip(axes, panels, shapes, matrices):
        image = ax.imshow(np.ma.masked_invalid(m), cmap=cmap, norm=norm, aspect="auto", origin="lower")
        ax.set_xticks(range(len(alphas)), [_alpha_label(a) for a in alphas])
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
        ax.set_xlabel(_alpha_axis(key[2]))
        ax.set_ylabel("layer")
        ax.set_title(_facet_title(key), fontsize=9)
        fontsize = 8 if len(alphas) <= 8 else 6
        for (i, j), v in np.ndenumerate(m):
            if np.isfinite(v):
                dark = abs(norm(v) - 0.5) > 0.3
                ax.text(j, i, _fmt(float(v)), ha="center", va="center", fontsize=fontsize, color="white" if dark else "black")
    bar = fig.colorbar(image, ax=axes[: len(panels)], shrink=0.9)
    bar.set_label(_with_unit(f"Δ {metric} vs baseline", metric))
    fig.suptitle(f"Change from baseline: {_title(task, metric, baseline)}", fontsize=10)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    plt.close(fig)
    return write_atomic(path, buffer.getvalue())


def _alpha_axis(op: str) -> str:
    return {
        "add": "alpha (steering strength; 0 = baseline)",
        "replace": "alpha (interpolation toward v; 0 = baseline)",
        "clamp": "alpha (projection on v clamped to)",
        "ablate": "directional ablation (no alpha)",
    }[op]


def lines(path: Path, task: str, metric: str, rows: Sequence[dict]) -> Path:
    """The metric against alpha, one line per layer (per panel), the baseline dashed, ±stderr as a band."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    baseline = next((r for r in rows if r["config"] == BASELINE), None)
    panels = facets(rows)
    fig = plt.figure(figsize=lines_size(len(panels)), dpi=DPI, layout="constrained")
    cols, nrows = _panel_grid(len(panels))
    axes = list(fig.subplots(nrows, cols, squeeze=False).ravel())
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    for ax, (key, prows) in zip(axes, panels.items()):
        layers, alphas = panel_axes(prows)
        colours = plt.get_cmap("viridis")([i / max(1, len(layers) - 1) * 0.9 for i in range(len(layers))])
        if key[2] == "ablate":  # no alpha: the metric against the ablated layer
            pts = sorted(prows, key=lambda r: r["layer"])
            ax.plot([r["layer"] for r in pts], [r["value"] for r in pts], "o-", label="ablated")
            ax.set_xlabel("layer (direction ablated)")
            ax.set_xticks(layers)
        else:
            for colour, layer in zip(colours, layers):
                pts = {float(r["alpha"]): r for r in prows if r["layer"] == layer}
                if baseline is not None and key[2] in ("add", "replace"):
                    pts.setdefault(0.0, baseline)
                xs = sorted(pts)
                ys = [pts[x]["value"] for x in xs]
                ax.plot(xs, ys, "o-", color=colour, label=f"layer {layer}", markersize=4)
                errs = [pts[x].get("stderr") for x in xs]
                if all(e is not None for e in errs):
                    ax.fill_between(xs, [y - e for y, e in zip(ys, errs)], [y + e for y, e in zip(ys, errs)], color=colour, alpha=0.12)
            ax.set_xlabel(_alpha_axis(key[2]).replace("; 0 = baseline", ""))
        if baseline is not None:
            ax.axhline(baseline["value"], color="grey", linestyle="--", linewidth=1, label="baseline")
        ax.set_ylabel(_with_unit(metric, metric))
        ax.set_title(_facet_title(key), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_title(task, metric, baseline), fontsize=10)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    plt.close(fig)
    return write_atomic(path, buffer.getvalue())


# --- summary -------------------------------------------------------------------------------------------------


def _config_label(r: dict) -> str:
    if r["config"] == BASELINE:
        return "baseline"
    alpha = "" if r["alpha"] is None else f" α={r['alpha']:g}"
    return f"{r['vector']} L{r['layer']} {r['site']} {r['op']}{alpha} ({r['positions']})"


def _num(v: float | None, digits: int = 4) -> str:
    return "–" if v is None else f"{v:.{digits}g}"


def extremes(rows: Sequence[dict], higher_is_better: bool | None) -> tuple[dict | None, dict | None]:
    """(best configuration, largest change from baseline) among the non-baseline rows of one metric."""
    grid = [r for r in rows if r["config"] != BASELINE and r["value"] is not None and math.isfinite(r["value"])]
    if not grid:
        return None, None
    sign = -1.0 if higher_is_better is False else 1.0
    best = max(grid, key=lambda r: sign * r["value"])
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
    lines_ += ["", "## Per metric", "",
               "| task | metric | baseline | best configuration | its value | largest change from baseline | change |",
               "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (task, metric), mrows in metrics.items():
        hib = outcome.higher_is_better.get((task, metric))
        best, largest = extremes(mrows, hib)
        b = next((r for r in mrows if r["config"] == BASELINE), None)
        which = "lowest" if hib is False else "highest"
        lines_.append(
            f"| {task} | {metric} | {_num(b['value']) if b else '–'} | "
            f"{_config_label(best) + f' ({which})' if best else '–'} | {_num(best['value']) if best else '–'} | "
            f"{_config_label(largest) if largest else '–'} | {_fmt(largest['delta']) if largest else '–'} |"
        )
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
    """Write every output of a finished sweep into `folder`; returns {what: path(s)}."""
    folder = Path(folder)
    rows = outcome.rows
    written: dict[str, Any] = {}
    for config_id, results in outcome.lm_eval.items():
        write_atomic(folder / "lm-eval" / f"{slug(config_id)}.json", json.dumps(results, indent=2, default=_json_default))
    plots: dict[tuple[str, str], tuple[str, str]] = {}
    for (task, metric), mrows in by_metric(rows).items():
        if not facets(mrows):
            continue
        name = f"{slug(task)}-{slug(metric)}.png"
        heatmap(folder / "plots" / f"heatmap-{name}", task, metric, mrows)
        lines(folder / "plots" / f"lines-{name}", task, metric, mrows)
        plots[(task, metric)] = (f"plots/heatmap-{name}", f"plots/lines-{name}")
    written["plots"] = plots
    written["generations"] = write_atomic(folder / "generations.jsonl", _jsonl(outcome.generations))
    facts = {**run_facts(outcome.info, outcome.seconds), "sweep": str(outcome.sweep.path.absolute()),
             "configurations": [{**c.fields, "steering_key": c.steering.key()} for c in outcome.sweep.configs],
             "metrics": [list(k) for k in by_metric(rows)], "worker_facts": outcome.info.get("facts")}  # fmt: skip
    written["run"] = write_atomic(folder / "run.json", json.dumps(facts, indent=2, default=_json_default))
    written["summary"] = write_atomic(folder / "summary.md", summary_md(outcome, plots))
    written["csv"] = write_atomic(folder / "results.csv", _csv(rows))
    written["jsonl"] = write_atomic(folder / "results.jsonl", _jsonl({k: r.get(k) for k in COLUMNS} for r in rows))
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
            out.append(row)
    return out

