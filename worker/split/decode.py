"""generate_until pipelined round a pipeline group's ring (issue 26), as worker.split.schedule plans it.

The job's rows are cut into M >= K micro-batches (longest prompts first, at most batch_size rows each, as
worker.generate cuts them), all in flight at once: each rank holds its own layers' KV of every micro-batch and
runs its layers for micro-batch m while the next rank runs m - 1. The last rank alone runs the head, samples
(per-request seeds, stop strings, max_gen_toks: worker.sampling, as the unsplit kernel) and sends the new ids
to rank 0, which feeds the micro-batch's next round. The ids then travel on ahead of the hidden state, one int
per row (DONE: the row finished; POISONED: non-finite scores), so every rank drops the same rows and knows the
next shapes without a header or a collective. Each micro-batch computes exactly as the unsplit kernel's batch
of the same rows does, so the last rank's texts are the unsplit model's; the other ranks return None per request.

Prompts that share a prefix (few-shot families: worker.generate's) share it as on one worker: each family's
prefix KV is computed once per rank, its layers only (found in the rank's prefix store, worker.prefix_cache, or
computed in one pipelined run before the decode, a micro-batch per prefix: worker.split.stages); a micro-batch
is then a decode batch of parts (worker.generate.prompt_parts), its prefill round one forward per part (the
rows' prompts, or their suffixes after one shared prefix, read once where worker.cascade allows, else copied),
joined into one batch on every rank as the unsplit kernel joins them.

Every transfer is evaluated on its own (worker.split.stages.timed): a dead peer fails it at once ("[ring] ..."),
a hung one is caught by the group deadline as for pipelined scoring (cluster.groups.pool).
Conditional steering pipelines too: each row runs under "configuration" = its request index (Rows.configs), which
keeps its decision for the decode rounds (worker.hooks.condition), the decisions travel with the hidden state
(worker.split.pipeline), and a family's prefix runs once per combination of decisions (worker.hooks.condition_share).
Capture and grid jobs pipeline elsewhere (worker.capture, worker.grid.pipelined: its generation builds on these
micro-batches, each configuration's on its own prefix KV).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..generate import GenRequest, _decode_batches, _last_logits, join_prefills, prefill_part, prompt_families, prompt_parts
from ..generate import reads_one_prefix, texts
from ..hooks import Rows
from ..hooks.condition import conditional_gates
from ..prefix_cache import resumed, stored
from ..sampling import NON_FINITE, finite_flag, lookback, next_tokens, sample_keys, stopped
from ..score import _empty_cache, _prefix_body, _prefix_micros
from ..spec import Batching
from . import stages
from .pipeline import Pipe, passing
from .schedule import Step, round_opening, round_steps
from .stages import CLOCK, timed

DONE, POISONED = -1, -2
Part = tuple[list[GenRequest], Any, int]  # a prefill's rows, their shared prefix KV (None: none) and its length


class _Micro:
    """One micro-batch's decoding state on this rank: the same on every rank (caches aside), plus, on the last
    rank, what the sampler needs (keys, generated ids)."""

    def __init__(self, lm: Any, parts: list[Part], last: bool, ids: list[int] | None = None) -> None:
        self.lm, self.parts, self.prefills = lm, parts, []
        self.ids = ids  # the rows' request indices, which conditional steering keeps decisions by (Rows.configs)
        self.reqs = [r for rows, _, _ in parts for r in rows]
        self.live = list(range(len(self.reqs)))  # batch rows still generating, in cache order
        self.rounds, self.poisoned, self.sent = 0, False, [0] * len(self.reqs)
        if last:
            self.keys = [None if r.greedy else sample_keys(r) for r in self.reqs]
            self.lookbacks = [lookback(r.until) for r in self.reqs]
            self.generated: list[list[int]] = [[] for _ in self.reqs]

    def forwards(self) -> int:
        """This round's forwards: the prefill's one per part, then one."""
        return len(self.parts) if self.rounds == 0 else 1

    def advance(self, ids: list[int]) -> bool:
        """Take the round's ids (one per live row): drop the finished rows as the unsplit kernel does; True when
        none is left (the micro-batch closes)."""
        self.poisoned |= POISONED in ids
        keep = [j for j, v in enumerate(ids) if v >= 0]
        if keep and len(keep) < len(self.live):
            sel = mx.array(keep)
            for c in self.cache:
                c.filter(sel)
            self.live = [self.live[j] for j in keep]
            shift = min(self.pads[j] for j in keep)
            self.pads = [self.pads[j] - shift for j in keep]
            self.prompt_end -= shift
            self.pos -= shift
        self.tokens = mx.array([[ids[j]] for j in keep])
        return not keep

    def forward(self, k: int) -> tuple[list, mx.array]:
        """The round's k-th lazy forward under the job's hooks: (the caches it writes, the logits of each row's
        newest token). The prefill's parts, joined after the last one as worker.generate joins them; then one
        token a row."""
        if self.rounds == 0:
            start = sum(len(rows) for rows, _, _ in self.parts[:k])
            with self._named(range(start, start + len(self.parts[k][0]))):
                done = prefill_part(self.lm, *self.parts[k])
            self.prefills.append(done)
            if k == len(self.parts) - 1:
                self.cache, self.pads, self.pos, self.logits = join_prefills(self.prefills, self.parts)
                self.prompt_end, self.prefills = self.pos, []
            return done[0], done[3]
        B = len(self.live)
        rows = Rows(offset=self.pos, starts=mx.array(self.pads), ends=mx.full((B,), self.pos + 1),
                    prompt_ends=mx.full((B,), self.prompt_end))  # fmt: skip
        self.pos += 1
        with self._named(self.live), self.lm.hooks.forward(rows):
            self.logits = _last_logits(self.lm, self.tokens, self.cache)
        return self.cache, self.logits

    def _named(self, rows: Sequence[int]) -> Any:
        """Forwards inside run batch rows `rows` under their request indices, if given (else as the caller set)."""
        return self.lm.hooks.rows_under([self.ids[b] for b in rows] if self.ids is not None else None)

    def sample(self, eos: frozenset[int]) -> list[int]:
        """The last rank: each live row's next id, or DONE (EOS, a stop string, max_gen_toks) as the unsplit
        kernel decides; all POISONED when the scores are not finite."""
        logits = self.logits
        y = next_tokens(logits, [self.reqs[b] for b in self.live], [self.keys[b] for b in self.live], self.rounds)
        finite = finite_flag(logits)
        timed("busy", [y, finite, [c.state for c in self.cache]])
        if not finite.item() and not mx.isfinite(logits).all().item():
            return [POISONED] * len(self.live)
        out = []
        for b, tok in zip(self.live, y.tolist()):
            r, gen = self.reqs[b], self.generated[b]
            if tok not in eos:
                gen.append(tok)
            ends = tok in eos or bool(r.until and stopped(self.lm.tokenizer, gen, r.until, self.lookbacks[b]))
            out.append(DONE if ends or len(gen) >= r.max_gen_toks else tok)
        return out


class _Ring:
    """This rank's run of the decode plan: one round of one micro-batch at a time."""

    def __init__(self, lm: Any) -> None:
        self.lm, self.group, self.pipe = lm, lm.group, Pipe()
        self.rank, self.size = self.group.rank(), self.group.size()
        self.eos = frozenset(lm.tokenizer.eos_token_ids)
        self.built: int | None = None  # which of the round's forwards is built (its graph, caches and logits)
        self.writes: list = []
        self.logits: Any = None

    def round(self, m: int, micro: _Micro) -> bool:
        """Micro-batch m's next round; False once it closed."""
        first = micro.rounds == 0
        for step in round_opening(self.rank, self.size, m, first=first):
            micro.sent = self.recv_ids(step, len(micro.live))
        done = not first and micro.advance(micro.sent)
        self.built = None
        for step in round_steps(self.rank, self.size, m, first=first, done=done, forwards=micro.forwards()):
            self.step(step, micro)
        micro.rounds += 1
        return not done

    def step(self, step: Step, micro: _Micro) -> None:
        if self.built != step.forward and step.op in ("recv", "forward"):
            # the forward's graph, once (a receive is built from its first block's input)
            self.pipe.received = self.pipe.out = None
            self.writes, self.logits = micro.forward(step.forward)
            self.built = step.forward
        if step.op == "recv":
            timed("wait", [self.pipe.received])
        elif step.op == "forward" and self.rank < self.size - 1:
            timed("busy", [self.pipe.out, [c.state for c in self.writes]])
        elif step.op == "forward" and step.forward < micro.forwards() - 1:  # the last rank, a prefill's part
            timed("busy", [self.logits, [c.state for c in self.writes]])
        elif step.op == "send":
            timed("wait", [mx.distributed.send(self.pipe.out, step.peer, group=self.group)])
        elif step.op == "sample":
            micro.sent = micro.sample(self.eos)
            micro.poisoned |= POISONED in micro.sent
            CLOCK.micros += 1
        elif step.op == "send_ids":
            timed("wait", [mx.distributed.send(mx.array(micro.sent, mx.int32), step.peer, group=self.group)])
        # the round's last "forward" on the last rank runs inside "sample" (its layers, the head and the draw in
        # one evaluation)

    def recv_ids(self, step: Step, rows: int) -> list[int]:
        ids = mx.distributed.recv_like(mx.zeros((rows,), mx.int32), step.peer, group=self.group)
        timed("wait", [ids])
        return ids.tolist()


@dataclass
class _PrefixPass:
    """One family prefix's KV on this rank's layers, as worker.prefix_cache.prefix_kv computes it: from scratch,
    or on from the longest stored prefix of its tokens (`found`); a micro-batch of worker.split.stages."""

    lm: Any
    tokens: tuple[int, ...]
    found: tuple[int, list] | None
    cache: list | None = None

    def forward(self) -> mx.array:
        if self.found is None:
            self.cache = _empty_cache(self.lm)
            return _prefix_body(self.lm, self.tokens, self.cache)
        self.cache, h = resumed(self.lm, self.found[1], self.found[0], self.tokens)
        return h

    def keep(self) -> list:
        return [c.state for c in self.cache]


def shared_prefixes(lm: Any, prefixes: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], list | None]:
    """Each family prefix's KV of this rank's layers (None: the model's caches cannot share one): what the prefix
    store holds (every rank's store holds the same entries: worker.prefix_cache), the rest computed in one
    pipelined run, a micro-batch per prefix (rank r runs one while rank r + 1 runs the one before). Under conditional
    steering (no store) a prefix's micro-batches are its runs per combination of decisions (worker.score)."""
    ready: dict[tuple[int, ...], Any] = {}
    passes, conditional = [], []
    shares, gates = _empty_cache(lm) is not None, conditional_gates(lm.hooks)
    for tokens in map(tuple, prefixes):
        _, found = stored(lm, tokens)
        if found is not None and found[0] == len(tokens):
            ready[tokens] = found[1]
        elif gates:
            runs, ready[tokens] = _prefix_micros(lm, tokens)
            conditional += runs
        elif shares:
            passes.append(_PrefixPass(lm, tokens, found))
        else:
            ready[tokens] = None
    if passes or conditional:
        stages.run(lm, [stages.Micro(p.forward, keep=p.keep) for p in passes] + conditional, lambda _: None)
    ready.update((p.tokens, p.cache) for p in passes)
    return ready


def micro_parts(
    lm: Any, requests: Sequence[GenRequest], batching: Batching, size: int, prefixes: Callable = shared_prefixes
) -> tuple[list[GenRequest], list[list[tuple]]]:
    """The requests truncated as the unsplit kernel does, and the micro-batches: decode batches of prompt_parts'
    parts ((prefix KV or None, prefix length, request indices) each; the prefixes through `prefixes(lm, tokens)`
    (`shared_prefixes`; worker.grid.pipelined: a configuration's), then stored as prefix_kv stores them), longest
    prompts first, at most batch_size rows each, and at least `size` micro-batches where there are that many rows."""
    reqs, families = prompt_families(lm, requests, batching.prefix_reuse)
    rows = sum(len(idx) for _, idx in families)
    per = min(batching.batch_size, max(1, math.ceil(rows / size)))
    ready = prefixes(lm, [reqs[idx[0]].context[:prefix] for prefix, idx in families if prefix])
    reqs, parts = prompt_parts(lm, requests, batch_size=per, prefix_reuse=batching.prefix_reuse,
                               compute=lambda lm, tokens, found: ready[tokens])  # fmt: skip
    return reqs, _decode_batches(parts, per)


def generate(lm: Any, requests: Sequence[GenRequest], batching: Batching) -> list[str | None]:
    """generate_until on one rank of a pipeline group: the last rank returns the texts (the unsplit model's),
    the others None per request."""
    ring = _Ring(lm)
    last = ring.rank == ring.size - 1
    reqs, batches = micro_parts(lm, requests, batching, ring.size)
    if any(shared is not None for batch in batches for shared, _, _ in batch):
        reads_one_prefix(lm)  # its one-off self-check runs lockstep forwards: before the ring, on every rank
    micros = [_Micro(lm, [([reqs[i] for i in idx], shared, prefix) for shared, prefix, idx in batch], last,
                     [i for _, _, idx in batch for i in idx]) for batch in batches]  # fmt: skip
    out: list[list[int]] = [[] for _ in reqs]
    poisoned = []

    def closed(micro: _Micro) -> None:
        poisoned.append(micro.poisoned)
        for i, ids in zip(micro.ids, micro.generated if last else ()):
            out[i] = ids

    with passing(lm.model, ring.pipe):
        rounds(ring, micros, len(micros), closed)  # every micro-batch in flight at once
    if any(poisoned):
        raise ValueError(f"{NON_FINITE}: check the model's weights and the steering")
    return texts(lm, out, requests) if last else [None] * len(requests)


def rounds(ring: _Ring, micros: list, window: int, closed: Callable[[Any], None]) -> None:
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
