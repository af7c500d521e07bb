"""Conditional (CAST) steering on worker groups, on REAL mx.distributed rings of local processes (127.0.0.1, no Ray):
pipeline rings of K = 2 and 3 where the single intervention's condition layer sits on an earlier rank than the layer
it steers (jobs ll, gen, gen_family; K = 3: a rank in between passes the decisions on, worker.split.pipeline) or on
a rank before the last, which answers (ll_early, gen_early); the two interventions' layers fall as the split puts
them (at K = 2 each is decided and steered on one rank); and a tensor ring of 2 (every rank runs every layer).
Each job's numbers equal the unsplit conditional run's (pipeline <= 1e-5, tensor <= 1e-4; texts identical) and so
do the fired flags, from the rank that answers (pipeline: the last, the others hold None; tensor: rank 0):
loglikelihood and generation, short prompts and few-shot rows sharing a prefix (run once per combination of
decisions, through the pipeline), one conditional intervention and two (the second's condition read on the stream
the first steers), in mixed batches.

Model: the shipped TinyStories-260K (5 layers: 3|2 over 2 ranks, 2|2|1 over 3).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.ring import run_split
from test_steer_condition import ALPHA, PROMPTS, SHOTS, between, cast_rule, direction, ids, lm  # noqa: F401  fixtures
from test_steer_condition_share import A_COND, _b_sims, _condition, _two, _vector
from worker.generate import GenRequest
from worker.jobs import run
from worker.spec import Batching, Grouping, Intervention, Job, Steering
from worker.split.plan import pipeline_ranges

C_LAYER = 1  # on rank 0 of every split here


@pytest.fixture(scope="module")
def config(stories_path):
    return json.loads((Path(stories_path) / "config.json").read_text())


@pytest.fixture(scope="module")
def rows(lm):
    """16 short prompts (no shared prefix: decode pipelines) and the same behind a few-shot prefix (a family)."""
    return [ids(lm, p) for p in PROMPTS], [ids(lm, SHOTS + p) for p in PROMPTS]


@pytest.fixture(scope="module")
def settings(lm, rows, direction):
    """Thresholds that split the rows: one condition's at C_LAYER, and two conditional interventions' (as
    tests.test_steer_condition_share picks them: every combination of the two decisions occurs)."""
    short, shots = rows
    one = between([cast_rule(lm, c, direction, C_LAYER) for c in short + shots])
    ta = between([cast_rule(lm, c, direction, A_COND) for c in shots])
    tb = between(_b_sims(lm, direction, ta, shots))
    return direction, one, ta, tb


def _one(direction, threshold: float, layer: int) -> Steering:
    condition = _condition(direction, C_LAYER, threshold)
    return Steering(interventions=(Intervention(layer=layer, vector=_vector(3), alpha=ALPHA, condition=condition),))


def _work(size: int, config: dict, rows, settings) -> list[tuple]:
    """(label, job, requests, batching): the single intervention steers the last rank's first layer, decided on an
    earlier rank (`early`: steers layer 2, which the last rank lacks); the two interventions as in
    test_steer_condition_share."""
    direction, one, ta, tb = settings
    short, shots = rows
    single, two = _one(direction, one, pipeline_ranges(config, size)[-1][0]), _two(direction, ta, tb)
    early = _one(direction, one, 2)  # a layer the last rank does not own: it learns the decisions only from the relay
    end = (5, 6, 7)  # a three-token continuation
    return [("ll", Job(kind="loglikelihood", steering=single), [(c, end) for c in short + shots], Batching(batch_size=4)),
            ("ll_early", Job(kind="loglikelihood", steering=early), [(c, end) for c in short], Batching(batch_size=4)),
            ("gen_early", Job(kind="generate", steering=early), [GenRequest(context=c, max_gen_toks=12) for c in short], Batching(batch_size=4)),
            ("ll_two", Job(kind="loglikelihood", steering=two), [(c, end) for c in shots], Batching(batch_size=6)),
            ("gen", Job(kind="generate", steering=single), [GenRequest(context=c, max_gen_toks=12) for c in short], Batching(batch_size=4)),
            ("gen_family", Job(kind="generate", steering=single), [GenRequest(context=c, max_gen_toks=12) for c in shots], Batching(batch_size=5)),
            ("gen_two", Job(kind="generate", steering=two), [GenRequest(context=c, max_gen_toks=12) for c in shots], Batching(batch_size=16))]  # fmt: skip


CONDITIONAL = ("ll", "ll_early", "ll_two", "gen", "gen_early", "gen_family", "gen_two")  # pipelined: the last rank answers


@pytest.fixture(scope="module")
def unsplit(lm, config, rows, settings):
    return {size: {label: list(run(lm, job, reqs, b)) for label, job, reqs, b in _work(size, config, rows, settings)} for size in (2, 3)}


def _ring(stories_path, config, rows, settings, grouping: Grouping) -> list[dict]:
    """Each rank's report, its results by label."""
    work = _work(grouping.size, config, rows, settings)
    reports = run_split({"stories": stories_path}, grouping, [("stories", job, reqs, b) for _, job, reqs, b in work], timeout=600)
    for report in reports:
        report["results"] = {label: result for (label, *_), result in zip(work, report["results"])}
    return reports


@pytest.fixture(scope="module", params=[2, 3])
def pipeline(request, stories_path, config, rows, settings):
    return request.param, _ring(stories_path, config, rows, settings, Grouping(size=request.param, split="pipeline"))


def _same(got, want, tolerance: float) -> None:
    assert not isinstance(got, str), got
    assert [r[-1] for r in got] == [r[-1] for r in want]  # the fired flags
    if isinstance(want[0][0], str):  # generate: [text, fired]
        assert [r[0] for r in got] == [r[0] for r in want]
    else:  # loglikelihood: [logprob, greedy, fired]
        assert max(abs(g[0] - w[0]) for g, w in zip(got, want)) <= tolerance
        assert [g[1] for g in got] == [w[1] for w in want]


@pytest.mark.parametrize("label", CONDITIONAL)
def test_a_pipeline_ring_steers_as_the_unsplit_model(pipeline, unsplit, label):
    size, reports = pipeline
    want = unsplit[size][label]
    assert 0 < sum(r[-1] for r in want) < len(want)  # a mixed batch
    _same(reports[-1]["results"][label], want, 1e-5)
    for report in reports[:-1]:
        assert report["results"][label] == [None] * len(want)


def test_the_steering_changes_what_fired_rows_get(lm, config, rows, settings, unsplit):
    """The conditional runs above are not the plain run under another name."""
    work = {label: (job, reqs, b) for label, job, reqs, b in _work(2, config, rows, settings)}
    for label in ("ll", "gen"):
        job, reqs, b = work[label]
        plain = list(run(lm, Job(kind=job.kind), reqs, b))
        cond = unsplit[2][label]
        changed = [p != c[0] if label == "gen" else abs(p[0] - c[0]) > 1e-4 for p, c in zip(plain, cond)]  # plain texts: str
        assert any(changed) and all(c[-1] for c, ch in zip(cond, changed) if ch)  # only fired rows changed


def test_a_tensor_ring_steers_as_the_unsplit_model(stories_path, config, rows, settings, unsplit):
    reports = _ring(stories_path, config, rows, settings, Grouping(size=2, split="tensor"))
    for label, want in unsplit[2].items():
        _same(reports[0]["results"][label], want, 1e-4)  # rank 0 answers
