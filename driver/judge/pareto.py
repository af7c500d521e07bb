"""The trade-off a judge shows: per prompt set, each configuration's behaviour score against its judge fluency, one
point per configuration (the baseline and the prompting baselines marked apart), the Pareto front (no other
configuration is at least as good on both and better on one) joined by a line."""

from __future__ import annotations

from collections.abc import Sequence

from driver.judge.schema import PROMPT
from driver.sweep.plots import DPI, _png, unit
from driver.sweep.rows import BASELINE, finite

__all__ = ["pareto_plots", "behaviour", "front", "SIZE"]

FLUENCY = "judge_fluency"
SIZE = (6.5, 5.0)  # inches: 650 × 500 pixels at DPI


def behaviour(rows: Sequence[dict], task: str) -> str | None:
    """The behaviour a prompt set measures: `logprob_diff` (positive − negative targets) where it has targets, else
    the judge's concept rating; None without either."""
    metrics = {r["metric"] for r in rows if r["task"] == task}
    return next((m for m in ("logprob_diff", "judge_concept") if m in metrics), None)


def front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (at least as high on both axes, higher on one), by x."""
    keep = [i for i, (x, y) in enumerate(points)
            if not any(a >= x and b >= y and (a > x or b > y) for a, b in points)]  # fmt: skip
    return sorted(keep, key=lambda i: points[i])


def _points(rows: Sequence[dict], task: str, metric: str) -> list[tuple[float, float, dict]]:
    """(judge fluency, behaviour, the behaviour's row) of each configuration with both."""
    fluency = {r["config"]: r["value"] for r in rows if r["task"] == task and r["metric"] == FLUENCY and finite(r["value"])}
    return [(fluency[r["config"]], r["value"], r) for r in rows
            if r["task"] == task and r["metric"] == metric and finite(r["value"]) and r["config"] in fluency]  # fmt: skip


def _draw(task: str, metric: str, points: list[tuple[float, float, dict]]) -> bytes:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=SIZE, dpi=DPI)
    kinds = (("steering", lambda r: r["config"] != BASELINE and r.get("op") != PROMPT, "o", "tab:blue"),
             ("baseline (unsteered)", lambda r: r["config"] == BASELINE, "s", "black"),
             ("prompting baseline", lambda r: r.get("op") == PROMPT, "^", "tab:orange"))  # fmt: skip
    for label, mine, marker, colour in kinds:
        xs = [(x, y) for x, y, r in points if mine(r)]
        if xs:
            ax.scatter(*zip(*xs), marker=marker, color=colour, label=label, zorder=3)
    best = front([(x, y) for x, y, _ in points])
    ax.plot([points[i][0] for i in best], [points[i][1] for i in best], "--", color="grey", label="Pareto front", zorder=2)
    middle = sum(ax.get_xlim()) / 2
    for i in best:  # labelled inward, so a label at the edge stays in the figure
        right = points[i][0] > middle
        ax.annotate(points[i][2]["config"], points[i][:2], fontsize=6, xytext=(-3 if right else 3, 3), textcoords="offset points",
                    ha="right" if right else "left")  # fmt: skip
    ax.set_xlabel("judge fluency (0–2, expected rating)")
    ax.set_ylabel(f"{metric} ({unit(metric) or '0–2, expected rating'})")
    ax.set_title(f"{task}: behaviour against fluency, one point per configuration", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


def pareto_plots(rows: Sequence[dict]) -> dict[str, tuple[str, bytes]]:
    """{prompt set: (its behaviour metric, the PNG)} for every prompt set the judge rated."""
    out = {}
    for task in dict.fromkeys(r["task"] for r in rows if r["metric"] == FLUENCY):
        metric = behaviour(rows, task)
        points = _points(rows, task, metric) if metric else []
        if points:
            out[task] = (metric, _draw(task, metric, points))
    return out
