"""A sweep's dispatch, one grid per request kind, setting a configuration with non-finite scores aside.

Such a configuration does not fail the sweep: its log-likelihoods come back as they are (recorded as failed
cells), and it is left out of generation, whose kernel refuses NaN/inf next-token scores
(worker.sampling.NON_FINITE); should a configuration fail only while generating, the configurations are generated
one at a time to find it.

A conditional configuration (CAST, the file's `condition:`) is not a grid cell: its condition reads each row's
whole prompt, which a grid shares (worker.grid refuses it). Each runs as its own job, as `driver run --steer` runs it,
and its results say per request whether the condition fired (`Fired`)."""

from __future__ import annotations

from collections.abc import Sequence

from worker.sampling import NON_FINITE as GEN_NON_FINITE
from worker.spec import Job

from driver.sweep.rows import NON_FINITE, finite

FAILED_GENERATING = f"{GEN_NON_FINITE} while generating"


class Fired(dict):
    """{configuration index: {kind: [whether the condition fired, per request]}} of the conditional configurations."""

    def run(self, executor, c: int, kind: str, steering, requests: list) -> list:
        """The configuration's own job: its results as a grid gives them (the flag kept here)."""
        out = executor.run(Job(kind=kind, steering=steering), requests)
        self.setdefault(c, {})[kind] = [bool(r[-1]) for r in out]
        return [tuple(r[:2]) if kind == "loglikelihood" else r[0] for r in out]


def run_grids(executor, steerings: Sequence, wanted: dict[str, list], echo=print) -> tuple[dict[str, list], dict[int, str], Fired]:
    """({kind: [configuration][request] answers}, {configuration index: why it failed}, the conditional ones' fired
    flags); a failed configuration's generations are empty strings."""
    answers: dict[str, list] = {}
    failed: dict[int, str] = {}
    fired = Fired()
    if wanted.get("loglikelihood"):
        requests = wanted["loglikelihood"]
        echo(f"sweep: {len(requests)} loglikelihood requests × {len(steerings)} configurations")
        answers["loglikelihood"] = _each(executor, "loglikelihood", steerings, range(len(steerings)), requests, fired)
        failed = {c: NON_FINITE for c, row in enumerate(answers["loglikelihood"]) if not all(finite(a[0]) for a in row)}
    if wanted.get("generate"):
        requests = wanted["generate"]
        echo(f"sweep: {len(requests)} generate requests × {len(steerings) - len(failed)} configurations")
        answers["generate"] = _generate(executor, steerings, requests, failed, fired)
    return answers, failed, fired


def _each(executor, kind: str, steerings: Sequence, keep: Sequence[int], requests: list, fired: Fired) -> list:
    """[configuration in `keep`][request]: the unconditional ones in one grid, each conditional one as its own job."""
    grid = [c for c in keep if not steerings[c].conditional]
    out = dict(zip(grid, executor.run_grid(kind, [steerings[c] for c in grid], requests))) if grid else {}
    for c in keep:
        if c not in out:
            out[c] = fired.run(executor, c, kind, steerings[c], requests)
    return [out[c] for c in keep]


def _refused(e: Exception) -> bool:
    return isinstance(e, ValueError) and GEN_NON_FINITE in str(e)


def _generate(executor, steerings: Sequence, requests: list, failed: dict[int, str], fired: Fired) -> list[list[str]]:
    keep = [c for c in range(len(steerings)) if c not in failed]
    texts: dict[int, list[str]] = {}
    try:
        texts = dict(zip(keep, _each(executor, "generate", steerings, keep, requests, fired))) if keep else {}
    except ValueError as e:
        if not _refused(e):
            raise
        for c in keep:  # finished cells are cached: only the failing configuration's work is redone
            try:
                texts[c] = _each(executor, "generate", steerings, [c], requests, fired)[0]
            except ValueError as e:
                if not _refused(e):
                    raise
                failed[c] = FAILED_GENERATING
    return [texts.get(c, [""] * len(requests)) for c in range(len(steerings))]
