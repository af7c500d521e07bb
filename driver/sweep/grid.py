"""A sweep's grid dispatch, one per request kind, setting a configuration with non-finite scores aside.

Such a configuration does not fail the sweep: its log-likelihoods come back as they are (recorded as failed
cells), and it is left out of generation, whose kernel refuses NaN/inf next-token scores
(worker.sampling.NON_FINITE); should a configuration fail only while generating, the configurations are generated
one at a time to find it."""

from __future__ import annotations

from collections.abc import Sequence

from worker.sampling import NON_FINITE as GEN_NON_FINITE

from driver.sweep.rows import NON_FINITE, finite

FAILED_GENERATING = f"{GEN_NON_FINITE} while generating"


def run_grids(executor, steerings: Sequence, wanted: dict[str, list], echo=print) -> tuple[dict[str, list], dict[int, str]]:
    """({kind: [configuration][request] answers}, {configuration index: why it failed}); a failed
    configuration's generations are empty strings."""
    answers: dict[str, list] = {}
    failed: dict[int, str] = {}
    if wanted.get("loglikelihood"):
        requests = wanted["loglikelihood"]
        echo(f"sweep: {len(requests)} loglikelihood requests × {len(steerings)} configurations")
        answers["loglikelihood"] = executor.run_grid("loglikelihood", steerings, requests)
        failed = {c: NON_FINITE for c, row in enumerate(answers["loglikelihood"]) if not all(finite(a[0]) for a in row)}
    if wanted.get("generate"):
        requests = wanted["generate"]
        echo(f"sweep: {len(requests)} generate requests × {len(steerings) - len(failed)} configurations")
        answers["generate"] = _generate(executor, steerings, requests, failed)
    return answers, failed


def _refused(e: Exception) -> bool:
    return isinstance(e, ValueError) and GEN_NON_FINITE in str(e)


def _generate(executor, steerings: Sequence, requests: list, failed: dict[int, str]) -> list[list[str]]:
    keep = [c for c in range(len(steerings)) if c not in failed]
    texts: dict[int, list[str]] = {}
    try:
        texts = dict(zip(keep, executor.run_grid("generate", [steerings[c] for c in keep], requests))) if keep else {}
    except ValueError as e:
        if not _refused(e):
            raise
        for c in keep:  # finished cells are cached: only the failing configuration's work is redone
            try:
                texts[c] = executor.run_grid("generate", [steerings[c]], requests)[0]
            except ValueError as e:
                if not _refused(e):
                    raise
                failed[c] = FAILED_GENERATING
    return [texts.get(c, [""] * len(requests)) for c in range(len(steerings))]
