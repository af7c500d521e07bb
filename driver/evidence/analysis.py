"""A finished sweep's evidence, from its per-sample records: each record's split, every row's paired interval of its
change from the baseline, the steerability rows and the held-out selection (driver.sweep.report writes them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from driver.evidence.records import values
from driver.evidence.selection import assign, choose
from driver.evidence.stats import paired
from driver.evidence.steerability import steerability
from driver.sweep.rows import BASELINE, failures

__all__ = ["Evidence", "analyse", "attach_intervals", "INTERVAL_COLUMNS"]

INTERVAL_COLUMNS = ("delta_low", "delta_high")  # the paired 95 % interval of `delta`, in results.csv


@dataclass
class Evidence:
    records: list[dict]  # samples.jsonl
    steerability: list[dict]
    selection: list[dict]  # run.json's `selection`
    held_out: bool  # `select:` given: chosen on one part, reported on the other
    select: dict | None = None  # the file's {fraction, seed}
    counts: dict = field(default_factory=dict)  # {source: {split: samples}}


def _reproduces(per_sample: dict, value: float | None) -> bool:
    """Whether the per-sample values average to the row's value (lm-eval's aggregate is a mean): only then is an
    interval over them an interval of that row's change."""
    if value is None or not per_sample:
        return False
    mean = sum(per_sample.values()) / len(per_sample)
    return abs(mean - value) <= 1e-6 * max(1.0, abs(value))


def attach_intervals(rows: Sequence[dict], per_metric: dict) -> None:
    """Each non-baseline row's `delta_low`/`delta_high`: the paired 95 % interval of its change from the baseline
    over the samples both have (None where the metric has no per-sample values that reproduce the row's mean)."""
    base_value = {(r["task"], r["metric"]): r["value"] for r in rows if r["config"] == BASELINE}
    for r in rows:
        r["delta_low"] = r["delta_high"] = None
        per = per_metric.get((r["task"], r["metric"]), {})
        mine, base = per.get(r["config"], {}), per.get(BASELINE, {})
        if r["config"] == BASELINE or r.get("delta") is None or not _reproduces(mine, r["value"]):
            continue
        if not _reproduces(base, base_value.get((r["task"], r["metric"]))):
            continue
        common = [k for k in mine if k in base]
        interval = paired([mine[k] for k in common], [base[k] for k in common])
        if interval is not None:
            r["delta_low"], r["delta_high"] = interval["low"], interval["high"]


def _candidates(rows: Sequence[dict]) -> tuple[list[str], list[str]]:
    """(steering configurations that may be chosen best: not failed, fluent; prompting baselines)."""
    failed, ops, unfluent = failures(rows), {}, set()
    for r in rows:
        ops.setdefault(r["config"], r.get("op"))
        if r.get("fluent") is False:
            unfluent.add(r["config"])
    steering = [c for c, op in ops.items() if op not in (None, "prompt") and c != BASELINE and c not in failed and c not in unfluent]
    return steering, [c for c, op in ops.items() if op == "prompt" and c not in failed]


def _selection(per_metric: dict, parts: dict, rows: Sequence[dict], better: dict) -> list[dict]:
    steering, prompting = _candidates(rows)
    out = []
    for (source, metric), per_config in per_metric.items():
        higher = better.get((source, metric), True)
        if higher is None:
            continue
        chosen = choose(per_config, steering, prompting, parts.get(source), higher is not False, BASELINE)
        if chosen is not None:
            out.append({"source": source, "metric": metric, "higher_is_better": higher is not False, **chosen})
    return out


def analyse(outcome, select=None) -> Evidence:
    """The evidence of a finished sweep (driver.sweep.running.Outcome); sets `split` on its records and
    `delta_low`/`delta_high` on its rows. `select`: the file's `select:` (None: choose and report on every sample)."""
    records = outcome.samples
    parts = assign(records, select, outcome.generations)
    per_metric = values(records, outcome.generations)
    attach_intervals(outcome.rows, per_metric)
    selection = _selection(per_metric, parts, outcome.rows, outcome.higher_is_better)
    counts = {s: {k: sum(1 for v in p.values() if v == k) for k in set(p.values())} for s, p in parts.items()}
    return Evidence(records, steerability(records), selection, select is not None,
                    None if select is None else {"fraction": select.fraction, "seed": select.seed}, counts)  # fmt: skip

