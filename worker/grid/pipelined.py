"""Grids on a pipeline group (issue 26): every (configuration, batch) is a micro-batch of its own, pipelined.

Loglikelihood grids run through worker.split.stages as worker.score's pipelined kernel does: per configuration
its families' prefix passes and batches, cut as `loglikelihood` cuts them, one after another in one plan, so rank
r computes one (configuration, batch) while rank r + 1 computes the one before and the last rank alone runs the
head. Generation grids go round the ring as worker.split.decode's rounds do, (configuration, batch) micro-batches
taking their rounds in turn, as many in flight as one configuration's job would hold (or K). Prompts sharing a
prefix (few-shot families) read their configuration's prefix KV, as its own job would: one pipelined run of prefix
passes first (`family_prefixes`), one per (prefix, fingerprint on prompt positions: worker.prefix_cache), so the
unsteered configuration and those steering only `continuation` or `last` positions share one; each stored under
its fingerprint for later jobs. A rank keeps one KV for the configurations alike on its own layers and below (one
steering only a later rank's layers holds the unsteered KV here).

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
7 C n / 32 of C n / 4 at K = 4: 25 % and 12.5 %, not done). Likewise every rank runs every prefix pass (a rank
below a configuration's steered layer recomputes the unsteered KV, then keeps one copy), and configurations alike
on prompt positions decode their own rows rather than side by side on one prompt KV as the unsplit grid's do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..generate import GenRequest, prompt_families, reads_one_prefix, texts
from ..hooks.manager import point_layer
from ..load import LoadedModel
from ..prefix_cache import count, prompt_prints, start_from, store
from ..sampling import NON_FINITE
from ..score import _empty_cache, _micros, _rows
from ..spec import Batching
from ..split import decode, stages
from ..split.pipeline import passing
from ..steer import side_by_side
from .passes import _installs, splits_prompt


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
    """A decoding micro-batch of one configuration's rows (`parts`, as worker.split.decode's; `index`: the rows'
    request indices): each round's graph built under its hooks, its prefill on that configuration's prefix KV."""

    def __init__(self, lm: LoadedModel, parts: list[decode.Part], last: bool, config: int, index: list[int]) -> None:
        super().__init__(lm, parts, last)
        self.config, self.index = config, index

    def forward(self, k: int):
        with self.lm.hooks.rows_under([self.config]):
            return super().forward(k)


def generation(lm: LoadedModel, installs: Sequence[list], requests: Sequence[GenRequest], batching: Batching) -> list[list]:
    """Texts per request per configuration (each its independent steered run's); None on every rank but the last.
    Prompts sharing a prefix read their configuration's prefix KV (`family_prefixes`), as its own job would."""
    ring = decode._Ring(lm)
    reqs, groups = prompt_families(lm, requests, batching.prefix_reuse)
    wanted = [reqs[idx[0]].context[:prefix] for prefix, idx in groups if prefix]
    if wanted:
        reads_one_prefix(lm)  # its one-off self-check runs lockstep forwards: before the ring, on every rank
    prints, here = prompt_prints(lm, installs), prefix_owners(prompt_prints(lm, below(installs, lm.layers[1])))
    with lm.hooks.installed(side_by_side(installs)):
        kv = family_prefixes(lm, prints, here, wanted)
        size = -(-ring.size // len(installs))  # enough micro-batches in all to keep every rank busy
        micros = [m for c in range(len(installs)) for m in _steered(lm, ring, c, requests, batching, size, kv, here[c])]
        return _decoded(lm, ring, micros, len(installs), requests)


def _steered(lm: LoadedModel, ring: Any, config: int, requests: Sequence[GenRequest], batching: Batching, size: int,
             kv: dict, owner: int) -> list[_Steered]:  # fmt: skip
    """Configuration `config`'s micro-batches (decode.micro_parts': `size` at least), its families' prefills on the
    prefix KV `owner` holds here (kv[owner, prefix]): the side-by-side hooks installed have no fingerprint, so the
    store stays out of it (with no hook at all its entries are the unsteered configuration's, as kv's)."""
    reqs, batches = decode.micro_parts(lm, requests, batching, size, lambda _, ts: {tuple(t): kv[owner, tuple(t)] for t in ts})
    last = ring.rank == ring.size - 1
    return [_Steered(lm, [([reqs[i] for i in idx], shared, prefix) for shared, prefix, idx in batch], last, config,
                     [i for _, _, idx in batch for i in idx]) for batch in batches]  # fmt: skip


def _decoded(lm: LoadedModel, ring: Any, micros: list, configs: int, requests: Sequence[GenRequest]) -> list[list]:
    """The micro-batches decoded round the ring (the configurations' hooks installed): texts [request][config]."""
    last = ring.rank == ring.size - 1
    ids: list[list[Any]] = [[[] for _ in range(configs)] for _ in requests]  # a request no micro-batch holds: nothing
    poisoned = []

    def closed(micro: _Steered) -> None:
        poisoned.append(micro.poisoned)
        for i, out in zip(micro.index, micro.generated if last else ()):
            ids[i][micro.config] = out

    with passing(lm.model, ring.pipe):  # one configuration's job's worth of KV in flight, K micro-batches at least
        decode.rounds(ring, micros, max(ring.size, -(-len(micros) // configs)), closed)
    if any(poisoned):
        raise ValueError(f"{NON_FINITE}: check the model's weights and the steering")
    if not last:
        return [[None] * configs for _ in requests]
    by_config = [texts(lm, [ids[i][c] for i in range(len(requests))], requests) for c in range(configs)]
    return [list(row) for row in zip(*by_config)]


def below(installs: Sequence[list], end: int) -> list[list]:
    """Each configuration's hooks at layers below `end`: all that can change the KV of layers below it."""
    return [[(name, hook) for name, hook in install if point_layer(name) < end] for install in installs]


def prefix_owners(prints: Sequence[str | None]) -> list[int]:
    """Per configuration, the first one with its fingerprint on prompt positions (worker.prefix_cache.fingerprint):
    the one whose prefix KV it reads. A configuration of unknown ops (None) owns its own."""
    return [prints.index(p) if p is not None else c for c, p in enumerate(prints)]


def family_prefixes(lm: LoadedModel, prints: Sequence[str | None], here: Sequence[int], prefixes: Sequence[tuple]) -> dict:
    """{(configuration, prefix): its KV on this rank's layers (None: the model's caches cannot share one)} for the
    configurations `here` names (`prefix_owners` of their hooks on this rank's layers and below: configurations
    alike there share it). Computed once per (prefix, fingerprint on prompt positions) (`prefix_owners(prints)`),
    under that configuration's hooks (side by side, installed) on from its store entries, in one pipelined run, a
    micro-batch per pass (rank r runs one while rank r + 1 runs the one before); each stored under its fingerprint.
    Every rank runs every pass (their shapes are the same on every rank); a rank then keeps one KV per `here`."""
    owners, ready, passes = prefix_owners(prints), {}, []
    for c in sorted(set(owners)):
        for tokens in map(tuple, prefixes):
            found = start_from(lm, prints[c], tokens)
            if prints[c] is not None and store(lm).budget > 0:  # the store's counters, as prefix_kv keeps them
                count(lm, found, len(tokens))
            if found is not None and found[0] == len(tokens):
                ready[c, tokens] = found[1]
            else:
                passes.append((c, decode._PrefixPass(lm, tokens, found)))
    if passes and _empty_cache(lm) is not None:
        stages.run(lm, [_under(lm, c, stages.Micro(p.forward, keep=p.keep)) for c, p in passes], lambda _: None)
    ready.update(((c, p.tokens), p.cache) for c, p in passes)  # cache None: the model cannot share a prefix
    for c, tokens in [key for key in ready if here[key[0]] != key[0]]:  # alike on this rank: one KV
        ready[c, tokens] = ready[here[c], tokens]
    for c, p in passes:
        if prints[c] is not None and ready[c, p.tokens] is not None:
            store(lm).put(prints[c], p.tokens, ready[c, p.tokens])
    return ready
