"""The steerability plot (plots/steerability-<source>.png): per steering family, each layer's distribution of
per-sample slopes as a box (median, quartiles, whiskers to 1.5 IQR, every sample a dot), a line at slope 0, and
the layer's anti-steerable share (samples with slope < 0) written above its box."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["steerability_plots", "panels"]

_PANEL = ("vector", "site", "head", "op", "positions", "threshold")  # a family without its layer


def panels(rows: Sequence[dict]) -> dict[tuple, list[dict]]:
    """Steerability rows of one source, one panel per family but its layer, each panel's rows by layer."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r.get(k) for k in _PANEL), []).append(r)
    return {k: sorted(v, key=lambda r: r["layer"]) for k, v in out.items()}


def _panel_title(key: tuple) -> str:
    vector, site, head, op, positions, threshold = key
    at = site + ("" if head is None else f" head {head}")
    return f"vector {vector} at {at}\n{op}, positions {positions}" + ("" if threshold is None else f", threshold {threshold:g}")


def _draw(ax, prows: Sequence[dict]) -> None:
    import numpy as np

    data = [r["slopes"] for r in prows]
    ax.boxplot(data, showfliers=False, widths=0.5)
    rng = np.random.default_rng(0)  # the dots' jitter: the same picture on every run
    for i, slopes in enumerate(data, 1):
        ax.plot(i + rng.uniform(-0.12, 0.12, len(slopes)), slopes, ".", color="tab:blue", alpha=0.5, markersize=4)
    ax.axhline(0.0, color="grey", linestyle="--", linewidth=1)
    top = max(max(d) for d in data)
    span = (top - min(min(d) for d in data)) or 1.0
    for i, r in enumerate(prows, 1):
        ax.text(i, top + 0.06 * span, f"{r['anti_steerable']:.0%} anti", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(top=top + 0.2 * span)
    ax.set_xticks(range(1, len(prows) + 1), [str(r["layer"]) for r in prows])
    ax.set_xlabel("layer")


def steerability_plot(source: str, rows: Sequence[dict]) -> bytes:
    """One source's figure (rows: its steerability rows with `slopes`)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from driver.sweep.plots import DPI, _panel_grid, _png, unit  # here: importing driver.sweep runs the sweep's modules

    groups = panels(rows)
    cols, nrows = _panel_grid(len(groups))
    width = max(max(5.5, 1.5 + 0.7 * len(p)) for p in groups.values())
    fig = plt.figure(figsize=(cols * width + 0.5, nrows * 4.0 + 0.75), dpi=DPI, layout="constrained")
    axes = list(fig.subplots(nrows, cols, squeeze=False).ravel())
    for ax in axes[len(groups) :]:
        ax.set_visible(False)
    metric = rows[0]["metric"]
    per = f" ({unit(metric)} per unit alpha)" if unit(metric) else " (per unit alpha)"
    for ax, (key, prows) in zip(axes, groups.items()):
        _draw(ax, prows)
        ax.set_title(_panel_title(key), fontsize=9)
        ax.set_ylabel(f"slope of {metric}{per}", fontsize=8)
    fig.suptitle(f"Steerability on {source}: each sample's least-squares slope\nof {metric} against alpha (the baseline at alpha 0)\n"
                 "box: median and quartiles over samples; dots: samples\n\"anti\": share of samples with slope < 0 (anti-steerable)",
                 fontsize=9)  # fmt: skip
    return _png(fig)


def steerability_plots(rows: Sequence[dict]) -> dict[str, bytes]:
    """{source: PNG} for every source with steerability rows."""
    by_source: dict[str, list[dict]] = {}
    for r in rows:
        by_source.setdefault(r["source"], []).append(r)
    return {source: steerability_plot(source, srows) for source, srows in by_source.items()}
