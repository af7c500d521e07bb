"""The run of a checked patch plan on one `mlx-ray` model (or any executor), and its outcome.

1. The first pass: one request per pair without a cell, its clean and corrupt logit differences; a pair whose two
   are equal is refused in one line naming its line (`recovered` would divide by zero), before the grid runs.
2. The grid: every (pair, cell) request through the executor's `run`, each pair's cells contiguous (so they
   share its clean and corrupt runs on the worker), each result cached as it arrives under its own key: an
   interrupted run resumes, a grown grid computes only its new cells.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from worker.spec import Grouping, Job

from driver.patch.plan import Patch
from driver.patch.schema import PatchError

__all__ = ["Outcome", "run", "run_on", "check_effects"]

EQUAL = 1e-6  # clean and corrupt logit differences this close (relative, at least 1e-6 absolute) count as equal


@dataclass
class Outcome:
    """What a patch run produced, for driver.patch.report."""

    patch: Patch
    lds: list[tuple[float, float]]  # per pair: (clean, corrupt) logit difference
    values: list[list[float]]  # [pair][cell]: the patched (exact) or estimated (attribution) logit difference
    info: dict  # the executor's facts
    seconds: float  # the whole run
    grid_seconds: float  # the grid alone (cells/s)
    grid_computed: int  # grid requests computed (not from the cache)


def check_effects(patch: Patch, lds: Sequence[tuple[float, float]]) -> None:
    """The first pair whose clean and corrupt logit differences are equal, refused in one line naming its line."""
    same = [p for p, (clean, corrupt) in zip(patch.pairs, lds) if abs(clean - corrupt) <= EQUAL * max(1.0, abs(clean), abs(corrupt))]
    bad = [p for p, ld in zip(patch.pairs, lds) if not all(map(math.isfinite, ld))]
    if bad:
        raise PatchError(f"{patch.pairs_file}: line {bad[0].line}: the model's logit difference is not finite (NaN or inf) on this pair")
    if same:
        clean = lds[patch.pairs.index(same[0])][0]
        more = f" (so do lines {', '.join(str(p.line) for p in same[1:6])})" if len(same) > 1 else ""
        raise PatchError(f"{patch.pairs_file}: line {same[0].line}: the clean and corrupt prompts give the same logit difference "
                         f"({clean:.6g}){more}, so `recovered` would divide by zero: make the corrupt prompt change the answer")  # fmt: skip


def run_on(executor, patch: Patch, echo=print) -> Outcome:
    """Both passes on an open executor (driver.lm.local.LocalExecutor or cluster.executor.RayExecutor)."""
    start, job = time.monotonic(), Job(kind="patch")
    first = executor.run(job, patch.first_pass())
    lds = [(float(r[1]), float(r[2])) for r in first]
    check_effects(patch, lds)
    n_cells, n_pairs = len(patch.cells), len(patch.pairs)
    echo(f"patch: {n_cells} cell{'s' * (n_cells != 1)} x {n_pairs} pair{'s' * (n_pairs != 1)} ({n_cells * n_pairs} requests)")
    before, grid_start = _computed(executor.info()), time.monotonic()
    results = executor.run(job, patch.requests())
    grid_seconds, info = time.monotonic() - grid_start, executor.info()
    computed = _computed(info) - before if "requests_computed" in info else n_cells * n_pairs  # in process: all
    values = [[float(results[p * n_cells + c][0]) for c in range(n_cells)] for p in range(n_pairs)]
    return Outcome(patch, lds, values, info, time.monotonic() - start, grid_seconds, computed)


def _computed(info: dict) -> int:
    return sum((info.get("requests_computed") or {}).values())


def run(patch: Patch, *, workers: str = "all", address: str | None = None, output: Path, cache: str | None = None,
        threads: int | None = None, stage: bool = False, grouping: Grouping | None = None, notes: Sequence[str] = (),
        echo=print) -> Outcome:  # fmt: skip
    """Run a checked patch plan on one `mlx-ray` model (the model loaded once per worker); nothing is written here
    but the result cache (default OUTPUT/cache). `grouping`: the worker groups, resolved; `notes`: what auto chose."""
    from driver.checks.groups import tell
    from driver.lm.evaluation import open_model

    start = time.monotonic()
    model = patch.spec.model
    size, split = (grouping.size, grouping.split) if grouping else (model.group_size, model.split)
    args = {**patch.model_args, "workers": workers, "cache": cache or str(output / "cache"), "stage": stage,
            "group_size": size, "split": split}  # fmt: skip
    args |= {k: v for k, v in (("address", address), ("threads", threads)) if v is not None}
    lm = open_model(args)
    tell(notes)
    try:
        outcome = run_on(lm.executor, patch, echo)
    finally:
        lm.executor.close()
    outcome.seconds = time.monotonic() - start
    return outcome
