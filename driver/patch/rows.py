"""A patch run's numbers as tidy rows: per cell and metric, the mean over pairs ± its standard error (results.csv),
and per pair its tokens and logit differences (pairs.jsonl). Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence

from driver.sweep.rows import mean_stderr

COLUMNS = ("site", "layer", "position", "head", "method", "metric", "value", "stderr", "n")
METRICS = ("logit_diff", "recovered")


def recovered(value: float, clean: float, corrupt: float) -> float:
    """The share of the clean-vs-corrupt effect a cell brings back: (patched - corrupt) / (clean - corrupt)."""
    return (value - corrupt) / (clean - corrupt)


def _finite_mean(values: list[float]) -> tuple[float | None, float | None]:
    if not all(map(math.isfinite, values)):
        return None, None  # a non-finite pair makes the mean meaningless: written empty
    return mean_stderr(values)


def cell_rows(outcome) -> list[dict]:
    """Two rows per cell (logit_diff, recovered), in the plan's cell order."""
    rows = []
    for c, cell in enumerate(outcome.patch.cells):
        per_pair = [v[c] for v in outcome.values]
        shares = [recovered(v, clean, corrupt) for v, (clean, corrupt) in zip(per_pair, outcome.lds)]
        for metric, values in zip(METRICS, (per_pair, shares)):
            value, stderr = _finite_mean(values)
            rows.append({"site": cell.site, "layer": cell.layer, "position": cell.position, "head": cell.head,
                         "method": cell.method, "metric": metric, "value": value, "stderr": stderr, "n": len(values)})  # fmt: skip
    return rows


def pair_rows(outcome) -> list[dict]:
    """One object per pair: its line, texts, token ids, answer ids and clean and corrupt logit differences."""
    rows = []
    for pair, (clean, corrupt) in zip(outcome.patch.pairs, outcome.lds):
        rows.append({"line": pair.line, "clean": pair.clean, "corrupt": pair.corrupt, "correct": pair.correct, "wrong": pair.wrong,
                     "clean_tokens": list(pair.clean_ids), "corrupt_tokens": list(pair.corrupt_ids),
                     "correct_token": pair.correct_id, "wrong_token": pair.wrong_id,
                     "clean_logit_diff": clean, "corrupt_logit_diff": corrupt})  # fmt: skip
    return rows


def of_metric(rows: Sequence[dict], metric: str, method: str | None = None, site: str | None = None) -> list[dict]:
    """The rows of one metric (and method, site)."""
    return [r for r in rows if r["metric"] == metric and method in (None, r["method"]) and site in (None, r["site"])]
