"""One job on one loaded model: its steering installed around the kernel it names, removed right after.

The in-process executor and the Ray actor both call `run`, so a job means the same thing wherever it runs.
Its results come back as `Results`: a plain list that also carries the steering ops' notes for the head.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .capture import capture, pipelined_capture
from .generate import decode, generate, prompt_parts, texts
from .grid import run_grid
from .load import LoadedModel
from .prefix_cache import use_budget
from .score import loglikelihood, pipelined_loglikelihood
from .spec import Batching, Job
from .split import decode as pipelined_decode
from .split.stages import pipelined
from .steer import steered


class Results(list):
    """A job's results in request order, and `notes`: one line per intervention whose steering the head
    should warn about (it swamps the residual stream, or overflows its dtype). Pickles as a list plus notes."""

    def __init__(self, items: Sequence[Any] = (), notes: Sequence[str] = ()) -> None:
        super().__init__(items)
        self.notes = tuple(notes)


def run(lm: LoadedModel, job: Job, requests: Sequence[Any], batching: Batching) -> list:
    """Results in request order: (logprob, is_greedy) pairs, generated texts, or [points, hidden] arrays.

    A grid job (`job.grid`) gives, per request, the list of its results under each configuration in order.
    """
    use_budget(lm, batching.prefix_cache_mb << 20)
    if job.grid:
        return run_grid(lm, job.kind, job.grid, requests, batching)
    notes: list[str] = []
    fired: dict[int, bool] | None = {} if job.steering.conditional else None
    if fired is not None and job.kind != "loglikelihood":  # each row decided on its whole prompt; loglikelihood
        # shares a prefix plain and steered, each row picking its own (worker.hooks.condition_share)
        batching = batching.model_copy(update={"prefix_reuse": False})
    with steered(lm, job.steering, notes, fired):
        # Pipelined across a pipeline group (issue 26): loglikelihood (rolling too: the driver sends its windows as
        # Pipelined across a pipeline group (issue 26): loglikelihood (rolling too: the driver sends its windows as
        # loglikelihood pairs) and generate, steered or not, prefix families included; capture (its rows ride
        # forward); grid jobs (worker.grid, above); the last rank answers. Still lockstep (every stage after the
        # other, an all_gather per forward): generate under conditional steering, and generation grids whose
        # prompts share a prefix.
        if job.kind == "loglikelihood":
            out = (pipelined_loglikelihood if pipelined(lm) else loglikelihood)(lm, requests, batching)
        elif job.kind == "generate" and fired is not None:
            out = conditional_generate(lm, requests, batching.batch_size)
        elif job.kind == "generate" and pipelined(lm):
            out = pipelined_decode.generate(lm, requests, batching)
        elif job.kind == "generate":
            out = generate(lm, requests, batch_size=batching.batch_size, prefix_reuse=batching.prefix_reuse)
        else:
            out = (pipelined_capture if pipelined(lm) else capture)(lm, requests, job.points, batching)
    if fired is not None and job.kind != "capture":  # each result says whether its row was steered
        out = [[*r, fired.get(i, False)] if job.kind == "loglikelihood" else [r, fired.get(i, False)] for i, r in enumerate(out)]
    return Results(out, notes)


def conditional_generate(lm: LoadedModel, requests: Sequence[Any], batch_size: int) -> list[str]:
    """generate, each row run under "configuration" = its request index: conditional steering keeps each row's
    decision by it for the decode steps (worker.hooks.condition)."""
    reqs, parts = prompt_parts(lm, requests, batch_size=batch_size, prefix_reuse=False)
    return texts(lm, decode(lm, reqs, parts, batch_size, configs=range(len(reqs))), requests)
