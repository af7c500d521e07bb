"""Held-out selection: each source's samples split (by the file's `select: {fraction, seed}`) into a part that
chooses the best configuration and a part that reports it, so the reported number is not the maximum of many noisy
means on the same samples. Without `select:` both parts are every sample (and summary.md says so)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from driver.evidence.stats import mean_stderr, paired

__all__ = ["Select", "SELECT", "REPORT", "ALL", "split_samples", "assign", "choose"]

SELECT, REPORT, ALL = "select", "report", "all"


class Select(BaseModel):
    """The sweep file's `select:` (driver.sweep.schema): `fraction` of each source's samples choose the best
    configuration, the rest report it; `seed` fixes the split."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fraction: Annotated[float, Field(strict=True, allow_inf_nan=False)]
    seed: StrictInt = 0

    @field_validator("fraction")
    @classmethod
    def _share(cls, v: float) -> float:
        if not 0 < v < 1:
            raise ValueError(f"{v:g} is not between 0 and 1: give the share of each source's samples that choose the best, e.g. 0.5")
        return v


def split_samples(samples: Iterable, fraction: float, seed: int) -> dict:
    """{sample: SELECT or REPORT}: the distinct samples in sorted order, permuted by numpy's default_rng(seed); the
    first round(fraction · n) of the permutation (at least 1 and at most n − 1 when n ≥ 2) choose, the rest report.
    The same samples, fraction and seed always give the same split, whatever the configurations."""
    ids = sorted(set(samples))
    n = len(ids)
    k = min(max(round(fraction * n), 1), n - 1) if n >= 2 else n
    order = np.random.default_rng(seed).permutation(n)
    chosen = {ids[i] for i in order[:k]}
    return {s: SELECT if s in chosen else REPORT for s in ids}


def assign(records: Sequence[dict], select, generations: Sequence[dict] = ()) -> dict[str, dict]:
    """Each source's split of its samples (those of its records and, for a prompt set, of its generations' prompt
    lines: a prompt is in one part for every measure), {source: {sample: split}} (ALL without `select`); sets each
    record's `split`."""
    by_source: dict[str, set] = {}
    for r in records:
        by_source.setdefault(r["source"], set()).add(r["sample"])
    for g in generations:
        by_source.setdefault(g["prompt_set"], set()).add(g["line"])
    parts = {s: (split_samples(ids, select.fraction, select.seed) if select is not None else dict.fromkeys(ids, ALL))
             for s, ids in by_source.items()}  # fmt: skip
    for r in records:
        r["split"] = parts[r["source"]][r["sample"]]
    return parts


def _part(values: dict, part: dict | None, which: str) -> dict:
    """The values {(sample, seed): v} of one part (every one without a split)."""
    if part is None:
        return values
    return {k: v for k, v in values.items() if part.get(k[0], ALL) in (which, ALL)}


def _best(per_config: dict[str, dict], candidates: Sequence[str], part: dict | None, sign: float) -> str | None:
    scored = [(sign * mean_stderr(list(v.values()))[0], c) for c in candidates if (v := _part(per_config.get(c, {}), part, SELECT))]
    return max(scored, key=lambda t: t[0])[1] if scored else None


def _reported(per_config: dict[str, dict], config: str, part: dict | None, baseline: str) -> dict:
    chosen, reported = _part(per_config[config], part, SELECT), _part(per_config[config], part, REPORT)
    value, stderr = mean_stderr(list(reported.values())) if reported else (None, None)
    base = _part(per_config.get(baseline, {}), part, REPORT)
    common = sorted(set(reported) & set(base), key=repr)
    change = paired([reported[k] for k in common], [base[k] for k in common])
    return {"config": config, "select_value": mean_stderr(list(chosen.values()))[0], "report_value": value, "report_stderr": stderr,
            "n_select": len(chosen), "n_report": len(reported), "report_change": change}  # fmt: skip


def choose(per_config: dict[str, dict], steering: Sequence[str], prompting: Sequence[str], part: dict | None,
           higher: bool, baseline: str) -> dict | None:  # fmt: skip
    """The best steering configuration on the selection part of one (source, metric)'s values ({config: {(sample,
    seed): value}}), its value there and on the report part (with the paired interval of its change from the
    baseline on that part), and the best prompting baseline, chosen and reported alike, beside it (never chosen as
    best); None when no steering configuration has values."""
    sign = 1.0 if higher else -1.0
    best = _best(per_config, steering, part, sign)
    if best is None:
        return None
    out = _reported(per_config, best, part, baseline)
    prompt = _best(per_config, prompting, part, sign)
    out["prompting"] = _reported(per_config, prompt, part, baseline) if prompt is not None else None
    return out
