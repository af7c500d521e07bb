"""The patch kernel over one chunk of requests (worker.patch): pairs' runs, then exact rows, then attribution."""

from __future__ import annotations

from collections.abc import Sequence

from ..spec import Batching, head_shape
from ..split import stages
from . import pipelined
from .attribution import attribution
from .exact import exact
from .pairs import pairs_of, run_pairs, unchanged
from .spec import PatchRequest, cell_problem, group_problem


def patch(lm, requests: Sequence[PatchRequest], batching: Batching | None = None) -> list[tuple[float, float, float]]:
    """(value, clean_ld, corrupt_ld) per request, in order (worker.patch.spec says what each is)."""
    batching = batching or Batching()
    requests = [r if isinstance(r, PatchRequest) else PatchRequest.model_validate(r) for r in requests]
    check(lm, requests)
    pairs = pairs_of(requests, lm.max_length)
    cells = [(pair, i) for pair in pairs for i in pair.requests if _method(requests[i]) == "exact" and not unchanged(pair, requests[i].cell)]
    if stages.pipelined(lm):  # a pipeline group: the last rank answers, the others give None per request
        pipelined.run_pairs(lm, pairs, requests)
        values = pipelined.exact(lm, cells, requests, batching) | pipelined.attribution(lm, pairs, requests)
        if lm.group.rank() < lm.group.size() - 1:
            return [None] * len(requests)
    else:
        run_pairs(lm, pairs, requests)
        values = exact(lm, cells, requests, batching) | attribution(lm, pairs, requests)
    out: list = [None] * len(requests)
    for pair in pairs:
        for i in pair.requests:
            out[i] = (values.get(i, pair.corrupt_ld), pair.clean_ld, pair.corrupt_ld)
    return out


def _method(request: PatchRequest) -> str | None:
    return request.cell.method if request.cell is not None else None


def check(lm, requests: Sequence[PatchRequest]) -> None:
    """One line naming the first request this worker (group) cannot compute, before any forward."""
    problem = group_problem(getattr(lm, "grouping", None), [r.cell for r in requests])
    if problem:
        raise ValueError(problem)
    heads = head_shape(lm.config)[0]
    for i, r in enumerate(requests):
        problem = cell_problem(r.cell, lm.n_layers, heads, lm.hooks.missing) if r.cell is not None else None
        if problem:
            raise ValueError(f"request {i}: {problem}")
