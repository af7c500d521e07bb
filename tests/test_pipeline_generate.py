"""Pipelined generate_until (issue 26, worker.split.decode) on REAL mx.distributed rings of K = 2 and 3 local
processes (127.0.0.1, no Ray): the last rank's texts equal the unsplit model's per request, greedy and seeded-
sampled, with stop strings and max_gen_toks, at several batch sizes (so several micro-batch counts, M >= K), and
steered at a layer on every rank; only the last rank holds texts, and every rank computed. Prompts that share a
prefix stay on the lockstep path (worker.split.decode.pipelines) and keep their texts too.

Models: the shipped TinyStories-260K (a llama of 5 layers: 3|2 over 2 ranks, 2|2|1 over 3) and a generated qwen2
of 4 layers (3|1 and 2|1|1: its head weighs ~1.8 layers, worker.split.plan.head_layers): uneven layer counts on both.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from testbed.ring import run_split
from worker.generate import GenRequest
from worker.jobs import run
from worker.load import load
from worker.spec import Batching, Grouping, Intervention, Job, Steering
from worker.split import decode
from worker.split.plan import pipeline_ranges

CONFIGS: dict[str, dict] = {}  # each model's config.json, read by `models`: the split's layer plan is made from it
HIDDEN = 64


def _requests(sampled: bool, seed: int = 0) -> list[GenRequest]:
    """11 prompts of 1..30 tokens, stop strings on some, max_gen_toks from 0 to 24; sampled ones draw with their
    own seeds (temperature, top-k and top-p varied), one greedy row among them."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate([1, 30, 7, 19, 2, 12, 25, 4, 9, 16, 3]):
        context = tuple(rng.integers(3, 250, n).tolist())
        until = ((".", "\n") if i % 3 == 0 else ("the",) if i % 3 == 1 else ())
        settings = dict(do_sample=True, temperature=0.6 + 0.1 * (i % 5), top_p=(0.9, 1.0)[i % 2], top_k=(0, 50)[i % 2 == 0],
                        seed=1000 + i) if sampled and i != 4 else {}  # fmt: skip
        out.append(GenRequest(context=context, until=until, max_gen_toks=0 if i == 7 else 5 + 2 * i, **settings))
    return out


def _steer(layers: list[int]) -> Steering:
    rng = np.random.default_rng(sum(layers))
    return Steering(interventions=tuple(Intervention(layer=layer, vector=tuple(rng.standard_normal(HIDDEN).tolist()), alpha=4.0)
                                        for layer in layers))  # fmt: skip


def _family() -> list[GenRequest]:
    """Few-shot-like prompts sharing a 40-token prefix: the lockstep path (their prefix KV computed once)."""
    shots = tuple(np.random.default_rng(5).integers(3, 250, 40).tolist())
    return [GenRequest(context=shots + (7 + i, 9), max_gen_toks=6) for i in range(4)]


def _work(name: str, size: int) -> list[tuple]:
    """(label, job, requests, batching) on one model."""
    firsts = [start for start, _ in pipeline_ranges(CONFIGS[name], size)]  # a layer on every rank: each rank's first
    greedy, sampled = _requests(False), _requests(True)
    return [("greedy_b4", Job(kind="generate"), greedy, Batching(batch_size=4)),
            ("greedy_b16", Job(kind="generate"), greedy, Batching()),
            ("sampled_b3", Job(kind="generate"), sampled, Batching(batch_size=3)),
            ("sampled_b16", Job(kind="generate"), sampled, Batching()),
            ("steered", Job(kind="generate", steering=_steer(firsts)), greedy, Batching(batch_size=4)),
            ("family", Job(kind="generate"), _family(), Batching())]  # fmt: skip


@pytest.fixture(scope="module")
def models(stories_path, tmp_path_factory):
    from testbed.models import write_model

    qwen2 = write_model(tmp_path_factory.mktemp("pipegen") / "qwen2", arch="qwen2", layers=4, heads=4, kv_heads=2)
    folders = {"stories": stories_path, "qwen2": qwen2}
    CONFIGS.update({name: json.loads((Path(f) / "config.json").read_text()) for name, f in folders.items()})
    return folders


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
    reports = run_split(models, Grouping(size=size, split="pipeline"), work, timeout=400)
    labels = [(name, label) for name in models for label, *_ in _work(name, size)]
    for report in reports:
        by_model: dict = {}
        for (name, label), result in zip(labels, report["results"]):
            by_model.setdefault(name, {})[label] = result
        report["results"] = by_model
    return size, reports


LABELS = ["greedy_b4", "greedy_b16", "sampled_b3", "sampled_b16", "steered"]


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_the_last_rank_generates_the_unsplit_model_s_texts(ring, unsplit, name, label):
    size, reports = ring
    want, got = unsplit[name, size][label], reports[-1]["results"][name][label]
    assert got == want
    assert sum(map(bool, want)) >= 6  # most rows produced text (one has max_gen_toks 0)
    for report in reports[:-1]:  # sampling ran on the last rank only: the others hold no texts
        assert report["results"][name][label] == [None] * len(want)


@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_sampling_and_steering_changed_the_texts(unsplit, name):
    """The cases above are not the greedy run under other names: seeds and steering change what is generated."""
    texts = unsplit[name, 2]
    assert texts["sampled_b3"] != texts["greedy_b4"]
    assert texts["steered"] != texts["greedy_b4"]
    assert texts["greedy_b4"] == texts["greedy_b16"] and texts["sampled_b3"] == texts["sampled_b16"]


@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_prompts_sharing_a_prefix_stay_lockstep_and_keep_their_texts(ring, unsplit, name):
    size, reports = ring
    want = unsplit[name, size]["family"]
    assert all(r["results"][name]["family"] == want for r in reports)  # lockstep: every rank has the texts


def test_the_dispatch_rule(models):
    lm = load(str(models["stories"]))
    assert not decode.pipelines(lm, _family(), Batching())
    assert decode.pipelines(lm, _family(), Batching(prefix_reuse=False))
    assert decode.pipelines(lm, _requests(False), Batching())


def test_every_rank_computed_and_only_the_last_sampled(ring):
    size, reports = ring
    assert all(r["clock"].busy > 0 for r in reports)
    assert all(r["clock"].micros == 0 for r in reports[:-1])
    assert reports[-1]["clock"].micros > 0
    assert all(r["clock"].wait > 0 for r in reports)  # rank 0 waited on the ids coming back, the others on hidden states


def test_at_least_k_micro_batches_where_there_are_rows(models):
    lm = load(str(models["stories"]))
    for size in (2, 3):
        for batch in (1, 3, 4, 16):
            reqs, rows = decode.micro_rows(lm, _requests(False), batch, size)
            assert len(rows) >= size and max(map(len, rows)) <= batch
            assert sorted(i for idx in rows for i in idx) == [i for i, r in enumerate(reqs) if r.max_gen_toks > 0]
