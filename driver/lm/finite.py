"""A non-finite score is never a result: it fails the run in one line naming the task and the request."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

CHECK = "check the model's weights (a damaged file) and the steering (its alpha and vectors)"


class NonFiniteScore(ValueError):
    """A log-likelihood came back NaN or infinite; the message is one line."""


def _where(request: Any, index: int) -> str:
    task, doc = getattr(request, "task_name", None), getattr(request, "doc_id", None)
    if task is None:
        return f"request {index}"
    return f"task {task}, document {doc} (request {getattr(request, 'idx', 0)} of that document)"


def _under(steering: Any) -> str:
    steps = ", ".join(f"layer {i.layer} {i.op} alpha={i.alpha:g}" for i in getattr(steering, "interventions", ()))
    return f" under steering {steps}" if steps else ""


def check_scores(requests: Sequence[Any], scores: Sequence[Any], steering: Any = None) -> None:
    """Raise NonFiniteScore for the first score (a log-likelihood, or its (logprob, greedy) pair) that is NaN/inf;
    `steering` (a worker.spec.Steering) is named in the line when it has interventions."""
    for index, (request, score) in enumerate(zip(requests, scores)):
        value = score[0] if isinstance(score, (tuple, list)) else score
        if not math.isfinite(value):
            raise NonFiniteScore(f"{_where(request, index)}: the log-likelihood is {value}{_under(steering)}: {CHECK}")


@contextlib.contextmanager
def finite_generation(requests: Sequence[Any], steering: Any = None):
    """A worker's refusal to generate from NaN/inf scores (worker.sampling.NON_FINITE) as one line naming the task."""
    from worker.sampling import NON_FINITE

    try:
        yield
    except ValueError as e:
        if NON_FINITE not in str(e):
            raise
        tasks = sorted({str(getattr(r, "task_name", None)) for r in requests} - {"None"})
        where = f"task {', '.join(tasks)}" if tasks else "generation"
        raise NonFiniteScore(f"{where}: {NON_FINITE} while generating{_under(steering)}: {CHECK}") from None
