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
from .patch import run as patch
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
    with steered(lm, job.steering, notes, fired):
        # Pipelined across a pipeline group (issue 26): loglikelihood (rolling too: the driver sends its windows as
        # loglikelihood pairs) and generate, steered or not, conditional or not, prefix families included; capture
        # (its rows ride forward); grid jobs of every kind (worker.grid, above: generation on prompts sharing a prefix
        # too); the last rank answers. A conditional decision made on one rank travels with the hidden state to the
        # next (worker.split.pipeline). Nothing stays lockstep (every stage after the other, an all_gather per
        # forward) on a pipeline group; tensor groups run every kind lockstep.
        if job.kind == "loglikelihood":
            out = (pipelined_loglikelihood if pipelined(lm) else loglikelihood)(lm, requests, batching)
        elif job.kind == "generate" and pipelined(lm):
            out = pipelined_decode.generate(lm, requests, batching)
        elif job.kind == "generate" and fired is not None:
            out = conditional_generate(lm, requests, batching)
        elif job.kind == "generate":
            out = generate(lm, requests, batch_size=batching.batch_size, prefix_reuse=batching.prefix_reuse)
        elif job.kind == "patch":  # activation patching (issue 37): tensor groups lockstep, pipeline groups refused
            out = patch(lm, requests, batching)
        else:
            out = (pipelined_capture if pipelined(lm) else capture)(lm, requests, job.points, batching)
    if fired is not None and job.kind in ("loglikelihood", "generate"):  # each result says whether its row was steered
        out = [_with_fired(job.kind, r, fired.get(i, False)) for i, r in enumerate(out)]
    return Results(out, notes)


def _with_fired(kind: str, result: Any, fired: bool) -> Any:
    """A conditional job's result and whether its row fired; None (a pipeline rank that does not answer) stays."""
    if result is None:
        return None
    return [*result, fired] if kind == "loglikelihood" else [result, fired]


def conditional_generate(lm: LoadedModel, requests: Sequence[Any], batching: Batching) -> list[str]:
    """generate, each row run under "configuration" = its request index: conditional steering keeps each row's
    decision by it for the decode steps (worker.hooks.condition); prompt prefixes shared per combination of
    decisions (worker.hooks.condition_share)."""
    reqs, parts = prompt_parts(lm, requests, batch_size=batching.batch_size, prefix_reuse=batching.prefix_reuse)
    return texts(lm, decode(lm, reqs, parts, batching.batch_size, configs=range(len(reqs))), requests)
