"""One job on one loaded model: its steering installed around the kernel it names, removed right after.

The in-process executor and the Ray actor both call `run`, so a job means the same thing wherever it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .capture import capture
from .generate import generate
from .grid import run_grid
from .load import LoadedModel
from .score import loglikelihood
from .spec import Batching, Job
from .steer import steered


def run(lm: LoadedModel, job: Job, requests: Sequence[Any], batching: Batching) -> list:
    """Results in request order: (logprob, is_greedy) pairs, generated texts, or [points, hidden] arrays.

    A grid job (`job.grid`) gives, per request, the list of its results under each configuration in order.
    """
    if job.grid:
        return run_grid(lm, job.kind, job.grid, requests, batching)
    with steered(lm, job.steering):
        if job.kind == "loglikelihood":
            return loglikelihood(lm, requests, batching)
        if job.kind == "generate":
            return generate(lm, requests, batch_size=batching.batch_size, prefix_reuse=batching.prefix_reuse)
        return capture(lm, requests, job.points, batching)
