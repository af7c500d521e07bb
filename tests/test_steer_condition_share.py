"""Conditional (CAST) steering with shared prompt prefixes (worker.hooks.condition_share) on the real TinyStories-260K
model: few-shot rows share a long prefix that runs once per combination of decisions, and each row reads the one its
own decisions pick. Generation under one condition, and loglikelihood and generation under several conditional
interventions (one's condition layer reading a stream another one steers), give what running each row's whole
prompt gives, in mixed batches; the results say which rows fired, the same either way."""

from __future__ import annotations

import numpy as np
import pytest

from test_steer_condition import ALPHA, PROMPTS, SHOTS, between, cast_rule, direction, gate, ids, lm  # noqa: F401  fixtures
from worker.generate import GenRequest
from worker.hooks import condition_share
from worker.jobs import run
from worker.spec import Batching, Condition, Gate, Intervention, Job, Steering
from worker.steer import steered

WHOLE = Batching(batch_size=16, prefix_reuse=False)


@pytest.fixture
def passes(monkeypatch):
    """The prefix passes run (SharedPrefix.run calls): proof that the prefix was shared, not run per row."""
    calls = []
    original = condition_share.SharedPrefix.run
    monkeypatch.setattr(condition_share.SharedPrefix, "run", lambda self, v, body: calls.append(v) or original(self, v, body))
    return calls


@pytest.fixture
def picked(monkeypatch):
    """Per cascade prefill (each row's suffix on one copy of the prefix: worker.cascade), how many of its layers
    hold variants each row picks among: proof that a conditional family reads its prefixes once, not per row."""
    from worker import cascade

    counts = []
    original = cascade.prefill
    monkeypatch.setattr(cascade, "prefill", lambda lm, reqs, kv, prefix: counts.append(sum(isinstance(c, condition_share.Picked) for c in kv)) or original(lm, reqs, kv, prefix))
    return counts


def contexts(lm):
    return [ids(lm, SHOTS + p) for p in PROMPTS]


def _low(direction, condition=None) -> Steering:
    """Steering layer 2's output, decided at layer 1: the prefix's KV differs in layers 3 and 4 of the 5 (greedy
    texts then tell a row that read the wrong prefix)."""
    return Steering(interventions=(Intervention(layer=2, vector=_vector(3), alpha=ALPHA, condition=condition),))


@pytest.mark.parametrize("pool", ["mean", "last"])
def test_generation_with_a_shared_prefix_gives_what_each_whole_prompt_gives(lm, direction, pool, passes, picked):
    """Rows of one batch stop after 8, 12 or 16 tokens: the rows left keep their own picks."""
    reqs = [GenRequest(context=c, max_gen_toks=16 - 4 * (i % 3)) for i, c in enumerate(contexts(lm))]
    threshold = between([cast_rule(lm, c, direction, 1, pool) for c in contexts(lm)])
    job = Job(kind="generate", steering=_low(direction, gate(direction, threshold, pool=pool, layers=(1,))))
    whole = run(lm, job, reqs, WHOLE)
    assert passes == []
    shared = run(lm, job, reqs, Batching(batch_size=5))
    assert sorted(passes) == [0, 1]  # one family: its prefix once plain, once steered
    assert picked.count(2) == 4  # each of the 4 batches read both variants of layers 3 and 4, once each
    plain = run(lm, Job(kind="generate"), reqs, WHOLE)
    steered_texts = run(lm, Job(kind="generate", steering=_low(direction)), reqs, WHOLE)
    assert 4 <= sum(w[1] for w in whole) <= 12  # a mixed batch
    assert shared == whole
    assert [w[0] for w in whole] == [s if w[1] else p for p, s, w in zip(plain, steered_texts, whole)]
    assert sum(p != s for p, s in zip(plain, steered_texts)) >= 8  # the steering changes what is generated


# --- several conditional interventions --------------------------------------------------------------------------

A_COND, A_LAYER, B_COND, B_LAYER = 1, 2, 3, 4  # B's condition reads the stream A steers


def _vector(seed: int) -> tuple[float, ...]:
    return tuple(float(x) for x in np.random.default_rng(seed).standard_normal(64))


B_DIRECTION = np.random.default_rng(11).standard_normal(64).astype(np.float32)
# A's vector without its part along B's condition direction, and a small alpha: A's steering moves B's similarities
# a little (so a row's B decision depends on A's, and on which prefix sum it adds) without deciding them.
_C = B_DIRECTION.astype(np.float64) / np.linalg.norm(B_DIRECTION)
A_VECTOR, A_ALPHA = tuple(map(float, np.array(_vector(3)) - _C * (np.array(_vector(3)) @ _C))), 0.2


def _condition(direction, layer: int, threshold: float) -> Gate:
    return Gate(conditions=(Condition(vector=tuple(map(float, direction)), layers=(layer,), threshold=threshold),))


def _two(direction, ta: float, tb: float) -> Steering:
    return Steering(interventions=(
        Intervention(layer=A_LAYER, vector=A_VECTOR, alpha=A_ALPHA, condition=_condition(direction, A_COND, ta)),
        Intervention(layer=B_LAYER, vector=_vector(4), alpha=ALPHA, condition=_condition(B_DIRECTION, B_COND, tb)),
    ))  # fmt: skip


def _b_sims(lm, direction, ta: float, rows) -> list[float]:
    """B's similarity per row as the job sees it: at B's condition layer, after A steered the rows A fires on."""
    only_a = Steering(interventions=(_two(direction, ta, 0.0).interventions[0],))
    with steered(lm, only_a):
        return [cast_rule(lm, c, B_DIRECTION, B_COND) for c in rows]


@pytest.fixture(scope="module")
def thresholds(lm, direction):
    """(A's, B's): each half the rows, so the rows fall in every combination of the two decisions."""
    rows = contexts(lm)
    a = [cast_rule(lm, c, direction, A_COND) for c in rows]
    ta = between(a)
    b = _b_sims(lm, direction, ta, rows)
    tb = between(b)
    combos = {(x > ta, y > tb) for x, y in zip(a, b)}
    assert len(combos) == 4, combos
    return ta, tb, [x > ta or y > tb for x, y in zip(a, b)]


def test_two_conditional_interventions_share_a_prefix_in_loglikelihood(lm, direction, thresholds, passes):
    ta, tb, fired = thresholds
    reqs = [(c, ids(lm, " The end.")) for c in contexts(lm)]
    job = Job(kind="loglikelihood", steering=_two(direction, ta, tb))
    whole = run(lm, job, reqs, WHOLE)
    shared = run(lm, job, reqs, Batching(batch_size=6))
    assert sorted(passes) == [0, 1, 2, 3]  # each combination of the two decisions once
    assert [w[2] for w in whole] == fired and [s[2] for s in shared] == fired
    for w, s in zip(whole, shared):
        assert abs(s[0] - w[0]) <= 1e-5 and s[1] == w[1]


def test_two_conditional_interventions_share_a_prefix_in_generation(lm, direction, thresholds, passes, picked):
    ta, tb, fired = thresholds
    reqs = [GenRequest(context=c, max_gen_toks=10 - 3 * (i % 2)) for i, c in enumerate(contexts(lm))]
    job = Job(kind="generate", steering=_two(direction, ta, tb))
    whole = run(lm, job, reqs, WHOLE)
    shared = run(lm, job, reqs, Batching(batch_size=16))
    assert sorted(passes) == [0, 1, 2, 3]
    assert picked and all(n > 0 for n in picked)  # the variants read once each, in one cascade
    assert [w[1] for w in whole] == fired
    assert shared == whole


def test_past_max_gates_each_row_runs_its_whole_prompt(lm, direction, passes):
    """Four conditional interventions would need 16 prefix passes: each row runs its whole prompt instead."""
    assert condition_share.MAX_GATES == 3
    ivs = tuple(Intervention(layer=L, vector=_vector(L), alpha=2.0, condition=_condition(direction, L - 1, 0.0)) for L in (1, 2, 3, 4))
    reqs = [(c, ids(lm, " The end.")) for c in contexts(lm)[:6]]
    job = Job(kind="loglikelihood", steering=Steering(interventions=ivs))
    assert run(lm, job, reqs, Batching()) == run(lm, job, reqs, WHOLE)
    assert passes == []
