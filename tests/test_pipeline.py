"""Pipelined scoring (issue 26) on REAL mx.distributed rings of K = 2 and 3 local processes (127.0.0.1, no Ray):
the last rank's loglikelihood and rolling numbers equal the unsplit model's per request (<= 1e-5) for several
batch sizes (so several micro-batch counts), with and without prefix families, and steered at a layer on every
rank; only the last rank holds numbers, and every rank spent time computing (worker.split.stages.CLOCK). A
pipelined generate job (prompts sharing a prefix: worker.split.decode), a pipelined capture and a pipelined
generation grid on the same prompts (worker.grid.pipelined) between the scoring ones keep their numbers: the
paths share one ring.

Models: the shipped TinyStories-260K (a llama of 5 layers: 3|2 over 2 ranks, 2|2|1 over 3) and a generated qwen2
of 4 layers (3|1 and 2|1|1: its head weighs ~1.8 layers, worker.split.plan.head_layers): uneven layer counts on both.
"""

from __future__ import annotations

import numpy as np
import pytest

from testbed.ring import by_model, pipeline_models, run_split
from worker.generate import GenRequest
from worker.jobs import run
from worker.load import load
from worker.spec import Batching, Grouping, Intervention, Job, Steering
from worker.split.plan import pipeline_ranges

CONFIGS: dict[str, dict] = {}  # each model's config.json, read by `models`: the split's layer plan is made from it
HIDDEN = 64
BATCHINGS = {"b1": Batching(batch_size=1), "b3": Batching(batch_size=3), "b16": Batching(),
             "b2_no_families": Batching(batch_size=2, prefix_reuse=False)}  # fmt: skip


def _requests() -> list:
    """Loglikelihood pairs of several lengths: two families sharing a 40-token prefix (its KV runs once, on every
    rank), MMLU-like choices sharing one context, and rolling windows (lm-eval's own, of a 60-token document)."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    rng = np.random.default_rng(7)
    shots = tuple(rng.integers(3, 200, 40).tolist())
    pairs = [(shots + (5, 6, i), (10 + i, 11)) for i in range(5)] + [(shots[:35] + (9,), (40 + i,)) for i in range(3)]
    context = tuple(rng.integers(3, 200, 12).tolist())
    pairs += [(context, (60 + i,)) for i in range(4)]
    pairs += [(tuple(rng.integers(3, 200, n).tolist()), tuple(rng.integers(3, 200, 3).tolist())) for n in (2, 7, 19, 30)]
    document = rng.integers(3, 200, 60).tolist()
    windows = get_rolling_token_windows(token_list=document, prefix_token=1, max_seq_len=24, context_len=1)
    pairs += [(tuple(c), tuple(t)) for c, t in map(make_disjoint_window, windows)]
    return pairs


def _firsts(name: str, size: int) -> list[int]:
    """A layer on every rank: each rank's first."""
    return [start for start, _ in pipeline_ranges(CONFIGS[name], size)]


def _steer(layers: list[int]) -> Steering:
    rng = np.random.default_rng(sum(layers))
    return Steering(interventions=tuple(Intervention(layer=layer, vector=tuple(rng.standard_normal(HIDDEN).tolist()), alpha=3.0)
                                        for layer in layers))  # fmt: skip


def _work(name: str, size: int) -> list[tuple]:
    """(label, job, requests, batching) on one model; a pipelined generate job, capture and generation grid sit
    between the pipelined scoring ones."""
    pairs = _requests()
    out = [(f"ll_{b}", Job(kind="loglikelihood"), pairs, batching) for b, batching in BATCHINGS.items()]
    shots = tuple(range(3, 43))  # a 40-token shared prefix: its KV runs once (on every rank, its layers)
    gen = [GenRequest(context=shots + (5, 9, 20), max_gen_toks=6), GenRequest(context=shots + (7, 8), max_gen_toks=4)]
    points = tuple(f"resid_post.{layer}" for layer in _firsts(name, size))
    out.insert(2, ("generate", Job(kind="generate"), gen, Batching()))
    out.insert(3, ("capture", Job(kind="capture", points=points), [(shots + (5, 9), -1), ((1, 7, 8), 1)], Batching()))
    grid = (Steering(), _steer(_firsts(name, size)[-1:]))  # prompts sharing a prefix: its KV once per configuration
    out.insert(4, ("grid_generate", Job(kind="generate", grid=grid), gen, Batching()))
    out.append(("steered", Job(kind="loglikelihood", steering=_steer(_firsts(name, size))), pairs, Batching(batch_size=4)))
    return out


@pytest.fixture(scope="module")
def models(stories_path, tmp_path_factory):
    return pipeline_models(stories_path, tmp_path_factory.mktemp("pipeline"), CONFIGS)


@pytest.fixture(scope="module")
def unsplit(models):
    out = {}
    for name, folder in models.items():
        lm = load(str(folder))
        for size in (2, 3):
            out[name, size] = {label: list(run(lm, job, reqs, batching)) for label, job, reqs, batching in _work(name, size)}
    return out


@pytest.fixture(scope="module", params=[2, 3])
def ring(request, models):
    """(K, each rank's report with results {model: {label: results}}) from one pipeline ring of K processes."""
    size = request.param
    work = [(name, job, reqs, batching) for name in models for _, job, reqs, batching in _work(name, size)]
    reports = run_split(models, Grouping(size=size, split="pipeline"), work, timeout=600)
    labels = [(name, label) for name in models for label, *_ in _work(name, size)]
    by_model(reports, labels)
    return size, reports


def _scores(results) -> np.ndarray:
    assert not isinstance(results, str), results
    return np.array([lp for lp, _ in results])


@pytest.mark.parametrize("label", [*(f"ll_{b}" for b in BATCHINGS), "steered"])
@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_the_last_rank_scores_as_the_unsplit_model(ring, unsplit, name, label):
    size, reports = ring
    want, got = unsplit[name, size][label], reports[-1]["results"][name][label]
    assert np.abs(_scores(got) - _scores(want)).max() <= 1e-5
    assert [g for _, g in got] == [g for _, g in want]
    for report in reports[:-1]:  # the head ran on the last rank only: the others hold no numbers
        assert report["results"][name][label] == [None] * len(want)
    if label == "steered":  # the steering on every rank's first layer changed the numbers
        assert np.abs(_scores(got) - _scores(unsplit[name, size]["ll_b16"])).max() > 1e-3


@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_jobs_between_pipelined_ones_keep_their_results(ring, unsplit, name):
    size, reports = ring
    want = unsplit[name, size]["generate"]
    assert reports[-1]["results"][name]["generate"] == want  # pipelined: the last rank answers
    assert all(r["results"][name]["generate"] == [None] * len(want) for r in reports[:-1])
    got = reports[-1]["results"][name]["capture"]  # pipelined too: the rows ride forward to the last rank
    assert not isinstance(got, str), got
    for g, w in zip(got, unsplit[name, size]["capture"], strict=True):
        assert np.abs(g - w).max() <= 1e-5 * max(1.0, float(np.abs(w).max()))
    grid = unsplit[name, size]["grid_generate"]
    assert grid[0][0] != grid[0][1]  # the steering changed the text
    assert reports[-1]["results"][name]["grid_generate"] == grid  # pipelined too: the last rank answers
    assert all(r["results"][name]["grid_generate"] == [[None] * 2] * len(grid) for r in reports[:-1])


def test_every_rank_computed_and_only_the_last_read_numbers(ring):
    size, reports = ring
    for report in reports:
        clock = report["clock"]
        assert clock.busy > 0, clock
    assert all(r["clock"].micros == 0 for r in reports[:-1])
    assert reports[-1]["clock"].micros > 0
    assert all(r["clock"].wait > 0 for r in reports[1:])  # every rank past 0 waited on its receives


def test_sends_overlapped_with_the_next_compute_keep_the_numbers(models, monkeypatch):
    """worker.split.stages.OVERLAP (each send on a stream of its own, one in flight): same numbers, K = 3."""
    monkeypatch.setenv("ORCHARD_PIPELINE_OVERLAP", "1")
    pairs, batching = _requests(), Batching(batch_size=3)
    want = list(run(load(str(models["stories"])), Job(kind="loglikelihood"), pairs, batching))
    reports = run_split({"stories": models["stories"]}, Grouping(size=3, split="pipeline"),
                        [("stories", Job(kind="loglikelihood"), pairs, batching)], timeout=300)  # fmt: skip
    assert np.abs(_scores(reports[-1]["results"][0]) - _scores(want)).max() <= 1e-5
    assert all(r["overlap"] for r in reports)  # the setting reached every rank: the sends ran on their own stream
