"""Grids on a pipeline group (issue 26): every (configuration, batch) is a micro-batch of its own, pipelined.

Loglikelihood grids run through worker.split.stages as worker.score's pipelined kernel does: per configuration
its families' prefix passes and batches, cut as `loglikelihood` cuts them, one after another in one plan, so rank
r computes one (configuration, batch) while rank r + 1 computes the one before and the last rank alone runs the
head. Generation grids go round the ring as worker.split.decode's rounds do, (configuration, batch) micro-batches
taking their rounds in turn, as many in flight as one configuration's job would hold (or K).

Steering: every configuration's hooks are installed once for the job, each acting only on the rows that run under
it (worker.steer.side_by_side, Rows.configs); a rank builds each micro-batch's lazy graph under its configuration
(`hooks.rows_under`), and since hooks act when the graph is built, every rank steers the micro-batch it is
building with that micro-batch's configuration, at whichever of its layers the configuration names. One install
also means the hooks' idle check (worker.hooks.manager: one small all_sum) runs once per job, not per batch.

What pipelining trades for worker.grid's sharing, and why: the unsplit grid runs the unsteered blocks below each
configuration's split once per batch (and generation shares prompt KV between configurations through the prefix
store). Here each configuration runs every block of every rank. On a pipeline the group runs at its busiest
rank's pace, and that is the last one: every configuration steered anywhere runs the last rank's blocks, shared
or not. Sharing would idle the earlier ranks rather than shorten the run: with C configurations spread evenly over
n layers, the unsplit grid does about n + C n / 2 block passes per batch; pipelined over K ranks without sharing,
each rank does C n / K, so a group of 2 matches one unsplit worker with sharing and K ranks give about K / 2 of it
(sharing below each split inside the last rank's own blocks would cut its C n / 2 to about 3 C n / 8 at K = 2 and
7 C n / 32 of C n / 4 at K = 4: 25 % and 12.5 %, not done). Generation on prompts that share a prefix stays on the
lockstep grid (`pipelines`), which computes the prefix's KV once and decodes configurations alike on prompt
positions side by side; pipelined, each configuration runs its own prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..generate import GenRequest, families, texts
from ..load import LoadedModel
from ..sampling import NON_FINITE
from ..score import _micros, _rows
from ..spec import Batching
from ..split import decode, stages
from ..split.pipeline import passing
from ..steer import side_by_side
from .passes import _installs, splits_prompt


def pipelines(lm: LoadedModel, kind: str, requests: Sequence, batching: Batching) -> bool:
    """Whether this grid job runs pipelined: on a pipeline group, scoring always, generation on prompts sharing no
    prefix (`generation` runs every row's whole prompt; a shared prefix's KV is computed once on the lockstep grid)."""
    if not stages.pipelined(lm):
        return False
    return kind == "loglikelihood" or all(len(g) == 1 for g in families(requests, lm.max_length, batching.prefix_reuse))


def run(lm: LoadedModel, kind: str, steerings: Sequence, requests: Sequence, batching: Batching) -> list[list]:
    """Results per request per configuration ([request][configuration]); None on every rank but the last."""
    installs = _installs(lm, steerings)
    if kind == "loglikelihood":
        return scoring(lm, installs, splits_prompt(installs), requests, batching)
    return generation(lm, installs, requests, batching)


def _under(lm: LoadedModel, config: int, micro: stages.Micro) -> stages.Micro:
    """`micro` built under configuration `config`'s hooks; its numbers come back tagged with the configuration."""

    def forward():
        with lm.hooks.rows_under([config]):  # every row of the micro-batch: one entry broadcasts over them
            return micro.forward()

    head = (lambda h: (config, micro.head(h))) if micro.head is not None else None
    return stages.Micro(forward, head, micro.keep)


def scoring(lm: LoadedModel, installs: Sequence[list], split_prompt: bool, requests: Sequence, batching: Batching) -> list[list]:
    """(sum logprob, is greedy) per request per configuration; None on every rank but the last."""
    rows, trivial = _rows(requests, lm.max_length, split_prompt=split_prompt)
    results: list[list[Any]] = [[trivial.get(i)] * len(installs) for i in range(len(requests))]

    def collect(out) -> None:
        config, (index, sums, misses) = out
        for i, s, m in zip(index, sums.tolist(), misses.tolist()):
            results[i][config] = (s, m == 0)

    micros = [_under(lm, c, m) for c in range(len(installs)) for m in _micros(lm, rows, batching)]
    with lm.hooks.installed(side_by_side(installs)):
        last = stages.run(lm, micros, collect)
    return results if last else [[None] * len(installs) for _ in requests]


class _Steered(decode._Micro):
    """A decoding micro-batch of one configuration's rows: each round's graph built under its hooks."""

    def __init__(self, lm: LoadedModel, reqs: list[GenRequest], last: bool, config: int, index: list[int]) -> None:
        super().__init__(lm, [(reqs, None, 0)], last)  # one part: these prompts, no shared prefix
        self.config, self.index = config, index

    def forward(self, k: int):
        with self.lm.hooks.rows_under([self.config]):
            return super().forward(k)


def generation(lm: LoadedModel, installs: Sequence[list], requests: Sequence[GenRequest], batching: Batching) -> list[list]:
    """Texts per request per configuration (each its independent steered run's); None on every rank but the last."""
    ring = decode._Ring(lm)
    last = ring.rank == ring.size - 1
    per_config = -(-ring.size // len(installs))  # enough micro-batches in all to keep every rank busy
    plain = batching.model_copy(update={"prefix_reuse": False})  # this path's prompts share no prefix (worker.grid)
    reqs, batches = decode.micro_parts(lm, requests, plain, per_config)
    rows = [[i for _, _, idx in batch for i in idx] for batch in batches]
    micros: list[Any] = [_Steered(lm, [reqs[i] for i in idx], last, c, idx) for c in range(len(installs)) for idx in rows]
    ids: list[list[Any]] = [[[] for _ in installs] for _ in requests]  # a request no micro-batch holds generates nothing
    poisoned = []

    def closed(micro: _Steered) -> None:
        poisoned.append(micro.poisoned)
        for i, out in zip(micro.index, micro.generated if last else ()):
            ids[i][micro.config] = out

    with lm.hooks.installed(side_by_side(installs)), passing(lm.model, ring.pipe):
        _rounds(ring, micros, max(ring.size, len(rows)), closed)  # one configuration's job's worth of KV, K at least
    if any(poisoned):
        raise ValueError(f"{NON_FINITE}: check the model's weights and the steering")
    if not last:
        return [[None] * len(installs) for _ in requests]
    by_config = [texts(lm, [ids[i][c] for i in range(len(requests))], requests) for c in range(len(installs))]
    return [list(row) for row in zip(*by_config)]


def _rounds(ring: Any, micros: list, window: int, closed: Callable[[Any], None]) -> None:
    """Every live micro-batch takes its round in turn (worker.split.schedule.decode_steps), at most `window` live:
    one that closes is handed to `closed` and let go (its KV), and the next one comes in. A micro-batch closes in
    the same round on every rank (its ids say so), so every rank lets the same ones in, in the same order."""
    live, admitted = list(range(min(window, len(micros)))), min(window, len(micros))
    while live:
        kept = [m for m in live if ring.round(m, micros[m])]
        for m in [m for m in live if m not in kept]:
            closed(micros[m])
            micros[m] = None
        fresh = min(len(micros), admitted + window - len(kept))
        live, admitted = kept + list(range(admitted, fresh)), fresh
