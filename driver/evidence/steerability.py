"""Steerability (Tan et al. 2024): each sample's least-squares slope of its behaviour score against alpha, over
every alpha of a steering family and the baseline's 0, summarised per (family, source) with the share of samples
that steer the wrong way (slope < 0) and the mean per-sample Spearman correlation.

A family: the configurations that differ only in alpha (vector, layer, site, head, op, positions, threshold). The
unsteered baseline is alpha 0 of the ops for which alpha 0 changes nothing (add, replace); clamp's alpha 0 is a
steering of its own, so a clamp family's slope runs over its own alphas only. Ablation (no alpha) and prompting
baselines have no slope."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from driver.evidence.records import BASELINE
from driver.evidence.stats import mean_stderr, slope, spearman

__all__ = ["FAMILY", "COLUMNS", "behaviour", "steerability"]

FAMILY = ("vector", "layer", "site", "head", "op", "positions", "threshold")
COLUMNS = FAMILY + ("source", "metric", "slope", "slope_stderr", "anti_steerable", "spearman", "n")
_ZERO_IS_BASELINE = ("add", "replace")
_SCORES = ("logprob_diff", "p_gold")  # the behaviour score: positive − negative targets, or a multiple-choice task's gold


def behaviour(records: Sequence[dict]) -> dict[str, str]:
    """{source: its behaviour score}: logprob_diff for a prompt set with positive and negative targets, p_gold for a
    multiple-choice task."""
    out: dict[str, str] = {}
    for r in records:
        if r["source"] not in out:
            found = next((m for m in _SCORES if m in r), None)
            if found:
                out[r["source"]] = found
    return out


def _families(records: Sequence[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in records:
        if r["config"] != BASELINE and r.get("alpha") is not None and r.get("op") not in (None, "prompt"):
            out.setdefault(tuple(r.get(k) for k in FAMILY), []).append(r)
    return out


def _points(family: Sequence[dict], baseline: dict, metric: str, with_zero: bool) -> dict:
    """{sample: [(alpha, value)]} of one family on one source, the baseline's at alpha 0 where it is alpha 0."""
    out: dict = {}
    for r in list(family) + (list(baseline.values()) if with_zero else []):
        v = r.get(metric)
        if v is not None and math.isfinite(v):
            out.setdefault(r["sample"], []).append((float(r["alpha"]) if r["config"] != BASELINE else 0.0, v))
    return out


def _row(key: tuple, source: str, metric: str, points: dict) -> dict | None:
    per_sample = {s: p for s, p in points.items() if len({a for a, _ in p}) >= 2}
    if not per_sample:
        return None
    slopes = np.array([slope(*zip(*p)) for p in per_sample.values()])
    rhos = [rho for p in per_sample.values() if not math.isnan(rho := spearman(*zip(*p)))]
    mean, stderr = mean_stderr(slopes)
    return {**dict(zip(FAMILY, key)), "source": source, "metric": metric, "slope": mean, "slope_stderr": stderr,
            "anti_steerable": float((slopes < 0).mean()), "spearman": float(np.mean(rhos)) if rhos else None,
            "n": len(slopes), "slopes": slopes.tolist()}  # fmt: skip


def steerability(records: Sequence[dict]) -> list[dict]:
    """One row per (family, source with a behaviour score) (COLUMNS, and `slopes`: each sample's, for the plot)."""
    scores = behaviour(records)
    baseline: dict[str, dict] = {}
    for r in records:
        if r["config"] == BASELINE:
            baseline.setdefault(r["source"], {})[r["sample"]] = r
    out = []
    for key, family in _families(records).items():
        op = key[FAMILY.index("op")]
        for source, metric in scores.items():
            mine = [r for r in family if r["source"] == source]
            row = _row(key, source, metric, _points(mine, baseline.get(source, {}), metric, op in _ZERO_IS_BASELINE)) if mine else None
            if row:
                out.append(row)
    return out
