"""A sweep's plots: a layers × alphas heatmap of the change from the baseline, and the metric against alpha; for
head sites (attn_head), a layers × heads heatmap (which heads move the behaviour).

One panel per (vector, site, op, positions), and per alpha for heads; a failed cell (non-finite score) reads
"failed", a configuration whose generations are not fluent is hatched (heatmap) or crossed (lines). Each function
returns the PNG's bytes."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

DPI = 100
BASELINE = "baseline"
ALPHAS, HEADS = "alpha", "head"  # a heatmap's columns

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



# --- shaping the rows for plots -------------------------------------------------------------------------------


def by_metric(rows: Sequence[dict]) -> dict[tuple[str, str], list[dict]]:
    """Rows grouped by (task, metric), in first-seen order."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        out.setdefault((r["task"], r["metric"]), []).append(r)
    return out


def facets(rows: Sequence[dict], columns: str = ALPHAS) -> dict[tuple, list[dict]]:
    """Non-baseline rows of one metric, one heatmap panel each: columns ALPHAS, the rows without a head grouped by
    (vector, site, op, positions); HEADS, the rows with one grouped by (vector, site, op, positions, alpha); a
    conditional sweep's rows by their threshold too, last: ("t", threshold)."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["config"] != BASELINE and r["op"] != "prompt" and (r.get("head") is not None) == (columns == HEADS):  # not a prompting baseline
            key = (r["vector"], r["site"], r["op"], r["positions"]) + ((r["alpha"],) if columns == HEADS else ())
            key += () if r.get("threshold") is None else (("t", r["threshold"]),)
            out.setdefault(key, []).append(r)
    return out


def _column(r: dict, columns: str) -> float | int | None:
    if columns == HEADS:
        return r["head"]
    return None if r["op"] == "ablate" else float(r["alpha"])


def panel_axes(rows: Sequence[dict], columns: str = ALPHAS) -> tuple[list[int], list]:
    """(layers, columns) of one panel: its alphas, where add/replace panels get alpha 0 (the baseline column),
    or its heads."""
    layers = sorted({r["layer"] for r in rows})
    op = rows[0]["op"]
    if columns == HEADS:
        return layers, sorted({r["head"] for r in rows})
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


def signed(v: float | None) -> str:
    """A change from the baseline as the plots and summary.md print it: signed, 2-3 digits, "–" for none."""
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
    if baseline is not None and baseline["value"] is None:
        base = "  (baseline failed)"
    elif baseline is not None:
        err = f" ± {baseline['stderr']:.3g}" if baseline.get("stderr") is not None else ""
        base = f"  (baseline {baseline['value']:.4g}{err})"
    return f"{task} · {metric}{base}"


def _facet_title(key: tuple) -> str:
    vector, site, op, positions = key[:4]
    rest = [k for k in key[4:] if not isinstance(k, tuple)]
    alpha = "" if not rest or rest[0] is None or op == "ablate" else f" α={rest[0]:g}"
    threshold = "".join(f", threshold {k[1]:g}" for k in key[4:] if isinstance(k, tuple))
    return f"vector {vector} at {site}\n{op}{alpha}, positions {positions}{threshold}"


def heatmap(task: str, metric: str, rows: Sequence[dict], columns: str = ALPHAS) -> bytes:
    """Layers × alphas (columns ALPHAS; rows without a head) or layers × heads (HEADS; rows with one) of the change
    from the baseline, one panel per facet (`facets`); failed cells read "failed", cells of configurations whose
    generations are not fluent are hatched."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    baseline = next((r for r in rows if r["config"] == BASELINE), None)
    panels = facets(rows, columns)
    shapes = [panel_axes(p, columns) for p in panels.values()]
    n_layers = max(len(layers) for layers, _ in shapes)
    matrices = []
    for (layers, alphas), prows in zip(shapes, panels.values()):
        m = np.full((len(layers), len(alphas)), np.nan)
        for r in prows:
            m[layers.index(r["layer"]), alphas.index(_column(r, columns))] = r["delta"] if r["delta"] is not None else np.nan
        if columns == ALPHAS and prows[0]["op"] in ("add", "replace") and (_has_value(baseline) or _own_baselines(prows)):
            m[:, alphas.index(0.0)] = 0.0  # for add and replace, alpha 0 is the baseline (a feature's: its unsteered value)
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
        ax.set_xticks(range(len(alphas)), [str(a) if columns == HEADS else _alpha_label(a) for a in alphas])
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
        ax.set_xlabel("attention head" if columns == HEADS else _alpha_axis(key[2]))
        ax.set_ylabel("layer")
        ax.set_title(_facet_title(key), fontsize=9)
        fontsize = 8 if len(alphas) <= 8 else 6
        muted = {(layers.index(r["layer"]), alphas.index(_column(r, columns))) for r in panels[key] if within_noise(r)}
        for (i, j), v in np.ndenumerate(m):
            if np.isfinite(v):
                dark = abs(norm(v) - 0.5) > 0.3 and (i, j) not in muted  # a muted cell is pale: black text
                ax.text(j, i, signed(float(v)), ha="center", va="center", fontsize=fontsize, color="white" if dark else "black")
        _mark_cells(ax, panels[key], layers, alphas, fontsize, columns)
    bar = fig.colorbar(image, ax=axes[: len(panels)], shrink=0.9)
    bar.set_label(_with_unit(f"Δ {metric} vs baseline", metric))
    marked = "\nhatched: generations not fluent (see summary.md)" if any(r.get("fluent") is False for r in rows) else ""
    marked += "\nmuted: the change's paired 95 % interval includes 0 (within noise)" if any(map(within_noise, rows)) else ""
    fig.suptitle(f"Change from baseline: {_title(task, metric, baseline)}{marked}", fontsize=10)
    return _png(fig)


def _alpha_axis(op: str) -> str:
    return {
        "add": "alpha (steering strength; 0 = baseline)",
        "replace": "alpha (interpolation toward v; 0 = baseline)",
        "clamp": "alpha (projection on v clamped to)",
        "ablate": "directional ablation (no alpha)",
    }[op]


def lines(task: str, metric: str, rows: Sequence[dict]) -> bytes:
    """The metric against alpha, one line per layer (per panel), the baseline dashed, ±stderr as a band; points of
    configurations whose generations are not fluent crossed out."""
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
            ax.plot([r["layer"] for r in pts], [_y(r) for r in pts], "o-", label="ablated")
            _cross_out(ax, [(r["layer"], r) for r in pts])
            ax.set_xlabel("layer (direction ablated)")
            ax.set_xticks(layers)
        else:
            for colour, layer in zip(colours, layers):
                pts = {float(r["alpha"]): r for r in prows if r["layer"] == layer}
                if key[2] in ("add", "replace") and (_has_value(baseline) or _own_baselines(prows)):
                    pts.setdefault(0.0, baseline if _has_value(baseline) else _own_baselines(prows)[layer])
                xs = sorted(pts)
                ys = [_y(pts[x]) for x in xs]
                ax.plot(xs, ys, "o-", color=colour, label=f"layer {layer}", markersize=4)
                _cross_out(ax, [(x, pts[x]) for x in xs])
                band = [(x, y, e) for x, y, e in zip(xs, ys, (pts[x].get("stderr") for x in xs)) if e is not None]
                if len(band) >= 2:  # ± 1 stderr where a point has one (a feature's unsteered point has none)
                    bx, by, be = zip(*band)
                    ax.fill_between(bx, [y - e for y, e in zip(by, be)], [y + e for y, e in zip(by, be)], color=colour, alpha=0.12)
            ax.set_xlabel(_alpha_axis(key[2]).replace("; 0 = baseline", ""))
        if baseline is not None and baseline["value"] is not None:
            ax.axhline(baseline["value"], color="grey", linestyle="--", linewidth=1, label="baseline")
        ax.set_ylabel(_with_unit(metric, metric))
        ax.set_title(_facet_title(key), fontsize=9)
        ax.grid(alpha=0.3)
        _legend(ax)
    fig.suptitle(_title(task, metric, baseline), fontsize=10)
    return _png(fig)




def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    plt.close(fig)
    return buffer.getvalue()


def _mark_cells(ax, prows: Sequence[dict], layers: list, columns_: list, fontsize: int, columns: str) -> None:
    """"failed" on a cell with no value (a non-finite score); hatching on a configuration that is not fluent."""
    from matplotlib.patches import Rectangle

    for r in prows:
        i, j = layers.index(r["layer"]), columns_.index(_column(r, columns))
        if r.get("error"):
            ax.text(j, i, "failed", ha="center", va="center", fontsize=fontsize, color="black")
            continue
        if within_noise(r):  # a white veil: the colour fades, the number stays readable
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=(1, 1, 1, 0.65), edgecolor="none", linewidth=0))
        if r.get("fluent") is False:
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="xx", edgecolor=(0, 0, 0, 0.3), linewidth=0))


def _cross_out(ax, points: Sequence[tuple[float, dict]]) -> None:
    """An x over each point whose configuration's generations are not fluent."""
    bad = [(x, r["value"]) for x, r in points if r.get("fluent") is False and r["value"] is not None]
    if bad:
        ax.plot(*zip(*bad), "x", color="black", markersize=9, linestyle="none", label="_crossed")


def _legend(ax) -> None:
    from matplotlib.patches import Patch

    if any(h.get_label() == "_crossed" for h in ax.get_lines()):
        ax.plot([], [], "x", color="black", markersize=9, linestyle="none", label="not fluent")
    handles, labels = ax.get_legend_handles_labels()
    if ax.collections:  # the bands fill_between drew
        handles.append(Patch(facecolor="grey", alpha=0.25, label="band: ± 1 stderr over samples"))
    ax.legend(handles=handles, fontsize=7)


def within_noise(r: dict) -> bool:
    """A change whose paired 95 % interval (`delta_low`, `delta_high`) includes 0."""
    lo, hi = r.get("delta_low"), r.get("delta_high")
    return lo is not None and hi is not None and lo <= 0 <= hi


def _has_value(r: dict | None) -> bool:
    return r is not None and r["value"] is not None


def _own_baselines(rows: Sequence[dict]) -> dict[int, dict]:
    """{layer: its unsteered point} for rows measured against their own unsteered value (an SAE feature's
    activation, no baseline row): value − delta; {} when any row lacks one."""
    out = {}
    for r in rows:
        if r["value"] is None or r.get("delta") is None:
            continue
        out.setdefault(r["layer"], {**r, "config": BASELINE, "alpha": 0.0, "value": r["value"] - r["delta"], "stderr": None,
                                    "delta": 0.0, "delta_low": None, "delta_high": None, "fluent": None, "error": None})  # fmt: skip
    layers = {r["layer"] for r in rows}
    return out if out and set(out) == layers else {}


def _y(r: dict) -> float:
    return math.nan if r["value"] is None else r["value"]
