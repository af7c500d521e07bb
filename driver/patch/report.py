"""A patch run's outputs, each written atomically (driver.checks.files.write_atomic) into the output folder:

    results.csv    one row per cell x metric (driver.patch.rows.COLUMNS): mean over pairs ± stderr, n
    pairs.jsonl    one object per pair: tokens, answer ids, clean and corrupt logit differences
    plots/patch-<site>.png   layer x position (tokens on the axis) or layer x head heatmaps of `recovered`
    summary.md     the effect, the top components, what the top 5 recover, workers, cells/s
    run.json       the file's settings, the run's facts (workers, cache counts, seconds)

A rerun into the same folder replaces these files and removes plots of sites it no longer has; the cache stays.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from driver.checks.files import write_atomic
from driver.patch.plots import heatmap
from driver.patch.rows import COLUMNS, cell_rows, pair_rows
from driver.patch.summary import summary_md
from driver.sweep.report import run_facts, strict

__all__ = ["write_outputs", "facts"]


def _csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: ("" if r[k] is None else r[k]) for k in COLUMNS} for r in rows)
    return buffer.getvalue()


def facts(outcome) -> dict:
    """The run's facts (driver.sweep.report.run_facts) with the grid's cell counts and rate."""
    total = len(outcome.patch.cells) * len(outcome.patch.pairs)
    rate = outcome.grid_computed / outcome.grid_seconds if outcome.grid_seconds > 0 else 0.0
    return {**run_facts(outcome.info, outcome.seconds), "cells": total, "cells_computed": outcome.grid_computed,
            "cells_cached": total - outcome.grid_computed, "grid_s": round(outcome.grid_seconds, 3), "cells_per_s": round(rate, 2)}  # fmt: skip


def _run_json(outcome, run: dict) -> str:
    p = outcome.patch
    body = {"file": str(p.path), "settings": p.spec.model_dump(mode="json"), "model_args": p.model_args,
            "pairs_file": str(p.pairs_file), "pairs": len(p.pairs), "cells": len(p.cells), "run": run}  # fmt: skip
    return json.dumps(strict(body), indent=2, default=str) + "\n"


def write_outputs(outcome, folder: str | os.PathLike) -> dict[str, Any]:
    """Write every output into `folder`; returns {what: path(s)}."""
    folder = Path(folder)
    rows, run = cell_rows(outcome), facts(outcome)
    written: dict[str, Any] = {"results": write_atomic(folder / "results.csv", _csv(rows))}
    lines = "".join(json.dumps(strict(r), ensure_ascii=False) + "\n" for r in pair_rows(outcome))
    written["pairs"] = write_atomic(folder / "pairs.jsonl", lines)
    plots = [write_atomic(folder / "plots" / f"patch-{site}.png", heatmap(rows, site, outcome.patch.labels)) for site in outcome.patch.spec.sites]
    for old in set((folder / "plots").glob("patch-*.png")) - set(plots):
        old.unlink(missing_ok=True)  # a previous run's site
    written["plots"] = plots
    written["summary"] = write_atomic(folder / "summary.md", summary_md(outcome, rows, run))
    written["run"] = write_atomic(folder / "run.json", _run_json(outcome, run))
    return written
