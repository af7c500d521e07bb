"""generate_until pipelined round a pipeline group's ring (issue 26), as worker.split.schedule plans it.

The job's rows are cut into M >= K micro-batches (longest prompts first, at most batch_size rows each, as
worker.generate cuts them), all in flight at once: each rank holds its own layers' KV of every micro-batch and
runs its layers for micro-batch m while the next rank runs m - 1. The last rank alone runs the head, samples
(per-request seeds, stop strings, max_gen_toks: worker.sampling, as the unsplit kernel) and sends the new ids
to rank 0, which feeds the micro-batch's next round. The ids then travel on ahead of the hidden state, one int
per row (DONE: the row finished; POISONED: non-finite scores), so every rank drops the same rows and knows the
next shapes without a header or a collective. Each micro-batch computes exactly as the unsplit kernel's batch
of the same rows does, so the last rank's texts are the unsplit model's; the other ranks return None per request.

Every transfer is evaluated on its own (worker.split.stages.timed): a dead peer fails it at once ("[ring] ..."),
a hung one is caught by the group deadline as for pipelined scoring (cluster.groups.pool).

What stays on the sequential (lockstep) path, by `pipelines` and worker.jobs: prompts that share a prefix
(their KV computed once and read by every row: worker.generate's families), capture and grid jobs. Conditional
steering pipelines: each row runs under "configuration" = its request index, which keeps its decision for the
decode rounds (worker.hooks.condition), and the decision travels with the hidden state (worker.split.pipeline).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ..generate import GenRequest, families, make_batch_cache, prompt_parts, texts
from ..hooks import Rows
from ..sampling import NON_FINITE, finite_flag, lookback, next_tokens, sample_keys, stopped
from ..spec import Batching
from .pipeline import Pipe, passing
from .schedule import Step, round_opening, round_steps
from .stages import CLOCK, timed

DONE, POISONED = -1, -2


def pipelines(lm: Any, requests: Sequence[GenRequest], batching: Batching) -> bool:
    """Whether this generate job runs pipelined: no prompts that would share a prefix (those stay lockstep)."""
    return all(len(g) == 1 for g in families(requests, lm.max_length, batching.prefix_reuse))


class _Micro:
    """One micro-batch's decoding state on this rank: the same on every rank (caches aside), plus, on the last
    rank, what the sampler needs (keys, generated ids)."""

    def __init__(self, lm: Any, reqs: list[GenRequest], last: bool, ids: list[int]) -> None:
        self.lm, self.reqs, self.ids = lm, reqs, ids  # ids: the rows' request indices (conditional steering's Rows.configs)
        P = max(len(r.context) for r in reqs)
        self.pads = [P - len(r.context) for r in reqs]
        self.tokens = mx.array([[0] * p + list(r.context) for p, r in zip(self.pads, reqs)])
        self.cache = make_batch_cache(lm.model, self.pads)
        self.pos = self.prompt_end = P
        self.live = list(range(len(reqs)))  # batch rows still generating, in cache order
        self.rounds, self.poisoned, self.sent = 0, False, [0] * len(reqs)
        if last:
            self.keys = [None if r.greedy else sample_keys(r) for r in reqs]
            self.lookbacks = [lookback(r.until) for r in reqs]
            self.generated: list[list[int]] = [[] for _ in reqs]

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

    def forward(self) -> mx.array:
        """This round's lazy forward under the job's hooks (the prefill first, then one token a row)."""
        B = len(self.live)
        if self.rounds == 0:
            rows = Rows(offset=0, starts=mx.array(self.pads), ends=mx.full((B,), self.pos), prompt_ends=mx.full((B,), self.pos))
        else:
            rows = Rows(offset=self.pos, starts=mx.array(self.pads), ends=mx.full((B,), self.pos + 1),
                        prompt_ends=mx.full((B,), self.prompt_end))  # fmt: skip
            self.pos += 1
        with self.lm.hooks.rows_under([self.ids[b] for b in self.live]), self.lm.hooks.forward(rows):
            h = self.lm.head.body(self.tokens, cache=self.cache)
        return h

    def sample(self, h: mx.array, eos: frozenset[int]) -> list[int]:
        """The last rank: each live row's next id, or DONE (EOS, a stop string, max_gen_toks) as the unsplit
        kernel decides; all POISONED when the scores are not finite."""
        logits = self.lm.head.head(h[:, -1:, :])[:, 0, :].astype(mx.float32)
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
        self.hidden: Any = None

    def round(self, m: int, micro: _Micro) -> bool:
        """Micro-batch m's next round; False once it closed."""
        first = micro.rounds == 0
        for step in round_opening(self.rank, self.size, m, first=first):
            micro.sent = self.recv_ids(step, len(micro.live))
        done = not first and micro.advance(micro.sent)
        self.pipe.received = self.pipe.out = self.hidden = None
        for step in round_steps(self.rank, self.size, m, first=first, done=done):
            self.step(step, micro)
        micro.rounds += 1
        return not done

    def step(self, step: Step, micro: _Micro) -> None:
        if self.hidden is None and step.op in ("recv", "forward"):
            self.hidden = micro.forward()  # the round's graph, once (a receive is built from the first block's input)
        if step.op == "recv":
            timed("wait", [self.pipe.received])
        elif step.op == "forward" and self.rank < self.size - 1:
            timed("busy", [self.pipe.out, [c.state for c in micro.cache]])
        elif step.op == "send":
            timed("wait", [mx.distributed.send(self.pipe.out, step.peer, group=self.group)])
        elif step.op == "sample":
            micro.sent = micro.sample(self.hidden, self.eos)
            micro.poisoned |= POISONED in micro.sent
            CLOCK.micros += 1
        elif step.op == "send_ids":
            timed("wait", [mx.distributed.send(mx.array(micro.sent, mx.int32), step.peer, group=self.group)])
        # "forward" on the last rank runs inside "sample" (its layers, the head and the draw in one evaluation)

    def recv_ids(self, step: Step, rows: int) -> list[int]:
        ids = mx.distributed.recv_like(mx.zeros((rows,), mx.int32), step.peer, group=self.group)
        timed("wait", [ids])
        return ids.tolist()


def micro_rows(lm: Any, requests: Sequence[GenRequest], batch_size: int, size: int) -> tuple[list[GenRequest], list[list[int]]]:
    """The requests truncated as the unsplit kernel does, and the micro-batches' request indices: longest prompts
    first, at most batch_size rows each, and at least `size` micro-batches where there are that many rows."""
    reqs, parts = prompt_parts(lm, requests, batch_size=batch_size, prefix_reuse=False)
    rows = sum(len(idx) for _, _, idx in parts)
    per = min(batch_size, max(1, math.ceil(rows / size)))
    if per < batch_size:
        reqs, parts = prompt_parts(lm, requests, batch_size=per, prefix_reuse=False)
    return reqs, [idx for _, _, idx in parts]


def generate(lm: Any, requests: Sequence[GenRequest], batching: Batching) -> list[str | None]:
    """generate_until on one rank of a pipeline group: the last rank returns the texts (the unsplit model's),
    the others None per request."""
    ring = _Ring(lm)
    last = ring.rank == ring.size - 1
    reqs, rows = micro_rows(lm, requests, batching.batch_size, ring.size)
    micros = [_Micro(lm, [reqs[i] for i in idx], last, idx) for idx in rows]
    live = list(range(len(micros)))
    with passing(lm.model, ring.pipe):
        while live:  # every live micro-batch takes its round in turn (schedule.decode_steps)
            live = [m for m in live if ring.round(m, micros[m])]
    if any(m.poisoned for m in micros):
        raise ValueError(f"{NON_FINITE}: check the model's weights and the steering")
    if not last:
        return [None] * len(requests)
    out: list[list[int]] = [[] for _ in reqs]
    for idx, micro in zip(rows, micros):
        for i, ids in zip(idx, micro.generated):
            out[i] = ids
    return texts(lm, out, requests)
