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
    """The prefix passes run (SharedPrefix.run calls) as (variant, the bits it decides): proof that the prefix was
    shared, not run per row."""
    calls = []
    original = condition_share.SharedPrefix.run
    monkeypatch.setattr(condition_share.SharedPrefix, "run", lambda self, v, body, mask=None: calls.append((v, mask)) or original(self, v, body, mask))
    return calls


@pytest.fixture
def spans(monkeypatch):
    """The spans of blocks the prefix passes ran, (first, past the last): proof that the blocks below a decision
    ran once for both of its outcomes."""
    calls = []
    original = condition_share.advance
    monkeypatch.setattr(condition_share, "advance", lambda lm, a, b, *rest: calls.append((a, b)) or original(lm, a, b, *rest))
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
def test_generation_with_a_shared_prefix_gives_what_each_whole_prompt_gives(lm, direction, pool, passes, spans, picked):
    """Rows of one batch stop after 8, 12 or 16 tokens: the rows left keep their own picks."""
    reqs = [GenRequest(context=c, max_gen_toks=16 - 4 * (i % 3)) for i, c in enumerate(contexts(lm))]
    threshold = between([cast_rule(lm, c, direction, 1, pool) for c in contexts(lm)])
    job = Job(kind="generate", steering=_low(direction, gate(direction, threshold, pool=pool, layers=(1,))))
    whole = run(lm, job, reqs, WHOLE)
    assert passes == []
    shared = run(lm, job, reqs, Batching(batch_size=5))
    assert sorted(passes) == [(0, 0), (0, 1), (1, 1)]  # one family: blocks 0-1 once, 2-4 once plain, once steered
    assert sorted(spans) == [(0, 2), (2, 5), (2, 5)]
    assert picked.count(2) == 4  # each of the 4 batches read both variants of layers 3 and 4, once each
    plain = run(lm, Job(kind="generate"), reqs, WHOLE)
    steered_texts = run(lm, Job(kind="generate", steering=_low(direction)), reqs, WHOLE)
    assert 4 <= sum(w[1] for w in whole) <= 12  # a mixed batch
    assert shared == whole
    assert [w[0] for w in whole] == [s if w[1] else p for p, s, w in zip(plain, steered_texts, whole)]
    assert sum(p != s for p, s in zip(plain, steered_texts)) >= 8  # the steering changes what is generated


def test_decode_steps_read_only_the_variants_the_rows_picked(lm, direction, monkeypatch):
    """Every row fires: the prompt forwards read both variants of layers 3 and 4 (their decisions are being made),
    every decode step only the steered one, as an unconditional steered run reads one prefix."""
    reads = []
    original = condition_share.Picked.read
    monkeypatch.setattr(condition_share.Picked, "read", lambda self: reads.append(len(x := original(self))) or x)
    reqs = [GenRequest(context=c, max_gen_toks=6) for c in contexts(lm)]
    out = run(lm, Job(kind="generate", steering=_low(direction, gate(direction, -1.0, layers=(1,)))), reqs, Batching(batch_size=16))
    assert all(o[1] for o in out)  # cos > -1: every row fired
    assert [o[0] for o in out] == run(lm, Job(kind="generate", steering=_low(direction)), reqs, WHOLE)
    prompt = reads.count(2)  # layers 3 and 4 of each prefill part's prompt forward
    assert prompt >= 2 and reads[:prompt] == [2] * prompt and len(reads) > prompt and set(reads[prompt:]) == {1}


# --- several conditional interventions --------------------------------------------------------------------------

A_COND, A_LAYER, B_COND, B_LAYER = 1, 2, 3, 4  # B's condition reads the stream A steers
# The prefix passes (variant, the decisions it makes: bit 0 A's, bit 1 B's): blocks 0-1 for all, 2-3 per A's
# decision, 4 per combination of both.
TREE = [(0, 0), (0, 1), (0, 3), (1, 1), (1, 3), (2, 3), (3, 3)]


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


def test_two_conditional_interventions_share_a_prefix_in_loglikelihood(lm, direction, thresholds, passes, spans):
    ta, tb, fired = thresholds
    reqs = [(c, ids(lm, " The end.")) for c in contexts(lm)]
    job = Job(kind="loglikelihood", steering=_two(direction, ta, tb))
    whole = run(lm, job, reqs, WHOLE)
    shared = run(lm, job, reqs, Batching(batch_size=6))
    assert sorted(passes) == TREE  # blocks 0-1 once, 2-3 per A's decision, 4 per combination of both
    assert sorted(spans) == [(0, 2), (2, 4), (2, 4), (4, 5), (4, 5), (4, 5), (4, 5)]
    assert [w[2] for w in whole] == fired and [s[2] for s in shared] == fired
    for w, s in zip(whole, shared):
        assert abs(s[0] - w[0]) <= 1e-5 and s[1] == w[1]


def test_two_conditional_interventions_share_a_prefix_in_generation(lm, direction, thresholds, passes, picked):
    ta, tb, fired = thresholds
    reqs = [GenRequest(context=c, max_gen_toks=10 - 3 * (i % 2)) for i, c in enumerate(contexts(lm))]
    job = Job(kind="generate", steering=_two(direction, ta, tb))
    whole = run(lm, job, reqs, WHOLE)
    shared = run(lm, job, reqs, Batching(batch_size=16))
    assert sorted(passes) == TREE
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


@pytest.mark.parametrize("site", ["resid_pre", "resid_mid", "attn_out", "mlp_out", "attn_head"])
def test_every_site_shares_the_blocks_below_it(lm, direction, site, passes, spans):
    """A conditional add inside block 2 (layer -3 of 5), decided at layer 1: blocks 0-1 run once, 2-4 per outcome,
    and the numbers are those of each row's whole prompt."""
    rows = contexts(lm)
    threshold = between([cast_rule(lm, c, direction, 1) for c in rows])
    vector = _vector(5)[:8] if site == "attn_head" else _vector(5)  # one head's output: head_dim 8
    iv = Intervention(layer=-3, site=site, head=0 if site == "attn_head" else None, vector=vector, alpha=ALPHA,
                      condition=_condition(direction, 1, threshold))  # fmt: skip
    job = Job(kind="loglikelihood", steering=Steering(interventions=(iv,)))
    reqs = [(c, ids(lm, " The end.")) for c in rows]
    whole = run(lm, job, reqs, WHOLE)
    shared = run(lm, job, reqs, Batching(batch_size=6))
    assert sorted(spans) == [(0, 2), (2, 5), (2, 5)]
    assert 4 <= sum(w[2] for w in whole) <= 12 and [s[2] for s in shared] == [w[2] for w in whole]
    for w, s in zip(whole, shared):
        assert abs(s[0] - w[0]) <= 1e-5 and s[1] == w[1]


# --- other architectures ------------------------------------------------------------------------------------------

ARCHS = ("gpt2", "gemma", "mixtral")  # position embeddings, scaled embeddings, mixture-of-experts blocks


@pytest.fixture(scope="module")
def archs(tmp_path_factory):
    from testbed.models import write_model
    from worker.load import load
    from worker.spec import ModelSpec

    root = tmp_path_factory.mktemp("condition-archs")
    return {a: load(ModelSpec(model=str(write_model(root / a, arch=a, hidden=64, layers=4, heads=4)), max_length=128)) for a in ARCHS}


def _two_at(threshold: float) -> Steering:
    """resid_post.1 decided at layer 1, attn_out.2 decided at layer 2: spans 0, 1 and 2-3 of the 4 blocks."""
    c1, c2 = (Gate(conditions=(Condition(vector=_vector(s), layers=(L,), threshold=threshold),)) for s, L in ((21, 1), (22, 2)))
    return Steering(interventions=(Intervention(layer=1, vector=_vector(23), alpha=4.0, condition=c1),
                                   Intervention(layer=2, site="attn_out", vector=_vector(24), alpha=4.0, condition=c2)))  # fmt: skip


@pytest.mark.parametrize("arch", ARCHS)
def test_other_architectures_grow_their_prefixes_alike(archs, arch, spans):
    """Random-weight models of three other families: the prefix grown in spans gives each row's whole-prompt numbers
    and decisions, in a batch whose rows fire differently."""
    rng = np.random.default_rng(3)
    prefix = [1, *rng.integers(3, 300, 40).tolist()]
    reqs = [(tuple(prefix + rng.integers(3, 300, int(rng.integers(2, 9))).tolist()), (5, 6)) for _ in range(12)]
    for threshold in (0.02, 0.05, 0.1, 0.2, 0.3, 0.5):  # the first at which the rows' decisions differ
        whole = run(archs[arch], Job(kind="loglikelihood", steering=_two_at(threshold)), reqs, WHOLE)
        if 0 < sum(w[2] for w in whole) < len(whole):
            break
    assert 0 < sum(w[2] for w in whole) < len(whole), [w[2] for w in whole]
    shared = run(archs[arch], Job(kind="loglikelihood", steering=_two_at(threshold)), reqs, Batching(batch_size=5))
    assert sorted(spans) == [(0, 1), (1, 2), (1, 2), (2, 4), (2, 4), (2, 4), (2, 4)]
    assert [s[2] for s in shared] == [w[2] for w in whole]
    for w, s in zip(whole, shared):
        assert abs(s[0] - w[0]) <= 1e-5 and s[1] == w[1]
