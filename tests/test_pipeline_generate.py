"""Pipelined generate_until (issue 26, worker.split.decode) on REAL mx.distributed rings of K = 2 and 3 local
processes (127.0.0.1, no Ray): the last rank's texts equal the unsplit model's per request, greedy and seeded-
sampled, with stop strings and max_gen_toks, at several batch sizes (so several micro-batch counts, M >= K), and
steered at a layer on every rank; only the last rank holds texts, and every rank computed. The same for few-shot
prompts (families sharing a prefix, worker.generate): each rank computes its layers' KV of each prefix once,
extends a stored shorter prefix, finds a stored one (its prefix store counts as the unsplit model's does), or
works with the store off; some micro-batches join parts of several families.

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
from worker.prefix_cache import store
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


_RNG = np.random.default_rng(9)
SHOTS = [tuple(_RNG.integers(3, 250, n).tolist()) for n in (48, 36, 41)]


def _fewshot(sampled: bool, longer: int = 0) -> list[GenRequest]:
    """13 few-shot-like prompts: a family of 6 on a 48-token prefix (`longer` tokens more when given: a stored
    48-token prefix then extends), two families of 2 (36 and 41 tokens: small parts that share a micro-batch), 3
    prompts sharing nothing; each row's question 1..9 tokens (21..29 sharing nothing); stop strings on some,
    max_gen_toks 0 to 16; sampled ones draw with their own seeds, one greedy row among them."""
    rng = np.random.default_rng(11 + longer)
    more = tuple(rng.integers(3, 250, longer).tolist())
    prefixes = [SHOTS[0] + more] * 6 + [SHOTS[1]] * 2 + [SHOTS[2]] * 2 + [()] * 3
    out = []
    for i, prefix in enumerate(prefixes):
        question = tuple(rng.integers(3, 250, 1 + (4 * i) % 9 + (0 if prefix else 20)).tolist())
        until = ((".", "\n") if i % 3 == 0 else ("the",) if i % 3 == 1 else ())
        settings = dict(do_sample=True, temperature=0.7 + 0.1 * (i % 4), top_p=(0.9, 1.0)[i % 2], top_k=(0, 40)[i % 2 == 0],
                        seed=2000 + i) if sampled and i != 3 else {}  # fmt: skip
        out.append(GenRequest(context=prefix + question, until=until, max_gen_toks=0 if i == 4 else 4 + i, **settings))
    return out


def _family() -> list[GenRequest]:
    """Four prompts sharing a 40-token prefix, nothing else."""
    shots = tuple(np.random.default_rng(5).integers(3, 250, 40).tolist())
    return [GenRequest(context=shots + (7 + i, 9), max_gen_toks=6) for i in range(4)]


def _steer(layers: list[int], positions: tuple[str, ...] = ("all",)) -> Steering:
    """Steering at each of `layers`, at `positions` in turn."""
    rng = np.random.default_rng(sum(layers))
    return Steering(interventions=tuple(Intervention(layer=layer, vector=tuple(rng.standard_normal(HIDDEN).tolist()), alpha=4.0,
                                                     positions=positions[i % len(positions)])
                                        for i, layer in enumerate(layers)))  # fmt: skip


def _work(name: str, size: int) -> list[tuple]:
    """(label, job, requests, batching) on one model, in the order a worker runs them (the prefix store carries
    the few-shot prefixes from one job to the next)."""
    firsts = [start for start, _ in pipeline_ranges(CONFIGS[name], size)]  # a layer on every rank: each rank's first
    greedy, sampled, shots, shots_sampled = _requests(False), _requests(True), _fewshot(False), _fewshot(True)
    return [("greedy_b4", Job(kind="generate"), greedy, Batching(batch_size=4)),
            ("greedy_b16", Job(kind="generate"), greedy, Batching()),
            ("sampled_b3", Job(kind="generate"), sampled, Batching(batch_size=3)),
            ("sampled_b16", Job(kind="generate"), sampled, Batching()),
            ("steered", Job(kind="generate", steering=_steer(firsts)), greedy, Batching(batch_size=4)),
            ("family", Job(kind="generate"), _family(), Batching()),
            ("fewshot_b3", Job(kind="generate"), shots, Batching(batch_size=3)),
            ("fewshot_b16", Job(kind="generate"), shots, Batching()),  # again: every prefix found in the store
            ("fewshot_sampled_b2", Job(kind="generate"), shots_sampled, Batching(batch_size=2)),
            ("fewshot_sampled_b16", Job(kind="generate"), shots_sampled, Batching()),
            ("fewshot_longer", Job(kind="generate"), _fewshot(False, longer=9), Batching(batch_size=5)),  # extends 48
            ("fewshot_steered", Job(kind="generate", steering=_steer(firsts, ("continuation", "all", "prompt"))), shots,
             Batching()),  # a prefix steered on some layers only (`continuation` never touches it)
            ("fewshot_unshared", Job(kind="generate"), shots, Batching(batch_size=4, prefix_reuse=False)),
            ("fewshot_no_store", Job(kind="generate"), shots, Batching(batch_size=6, prefix_cache_mb=0))]  # fmt: skip


@pytest.fixture(scope="module")
def models(stories_path, tmp_path_factory):
    return pipeline_models(stories_path, tmp_path_factory.mktemp("pipegen"), CONFIGS)


@pytest.fixture(scope="module")
def unsplit(models):
    """{(model, K): {label: results, "store": its prefix store's counters after the work}}, a fresh model each."""
    out = {}
    for name, folder in models.items():
        for size in (2, 3):
            lm = load(str(folder))
            out[name, size] = {label: list(run(lm, job, reqs, batching)) for label, job, reqs, batching in _work(name, size)}
            out[name, size]["store"] = store(lm).stats()
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


LABELS = ["greedy_b4", "greedy_b16", "sampled_b3", "sampled_b16", "steered", "family", "fewshot_b3", "fewshot_b16",
          "fewshot_sampled_b2", "fewshot_sampled_b16", "fewshot_longer", "fewshot_steered", "fewshot_unshared",
          "fewshot_no_store"]  # fmt: skip


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_the_last_rank_generates_the_unsplit_model_s_texts(ring, unsplit, name, label):
    size, reports = ring
    want, got = unsplit[name, size][label], reports[-1]["results"][name][label]
    assert got == want
    assert sum(map(bool, want)) >= len(want) // 2  # most rows produced text (one has max_gen_toks 0)
    for report in reports[:-1]:  # pipelined, sampling on the last rank only: the others hold no texts
        assert report["results"][name][label] == [None] * len(want)


@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_sampling_steering_and_prefixes_changed_the_texts(unsplit, name):
    """The cases above are not the greedy run under other names: seeds, steering and a longer prefix change what
    is generated; the batching, sharing prefixes or not and the store do not."""
    texts = unsplit[name, 2]
    for plain, other in [("greedy_b4", "sampled_b3"), ("greedy_b4", "steered"), ("fewshot_b3", "fewshot_sampled_b2"),
                         ("fewshot_b3", "fewshot_steered"), ("fewshot_b3", "fewshot_longer")]:  # fmt: skip
        assert texts[plain] != texts[other]
    assert texts["greedy_b4"] == texts["greedy_b16"] and texts["sampled_b3"] == texts["sampled_b16"]
    for label in ("fewshot_b16", "fewshot_unshared", "fewshot_no_store"):
        assert texts[label] == texts["fewshot_b3"]
    assert texts["fewshot_sampled_b2"] == texts["fewshot_sampled_b16"]


def test_a_few_shot_job_pipelines(ring):
    """The dispatch rule (worker.jobs): generate on a pipeline group pipelines, prompts sharing a prefix too (the
    lockstep path would leave the texts on every rank); the last rank sampled every micro-batch's rounds."""
    size, reports = ring
    for label in ("family", "fewshot_b3", "fewshot_no_store"):
        got = reports[-1]["results"]["stories"][label]
        assert len(got) >= 4 and all(isinstance(t, str) for t in got)
        assert all(r["results"]["stories"][label] == [None] * len(got) for r in reports[:-1])


@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_every_rank_s_prefix_store_counts_as_the_unsplit_model_s(ring, unsplit, name):
    """Each rank stores its layers' share of each family prefix and finds, extends and misses as one worker does
    (the same entries and bytes: a rank counts its share as the whole model's KV)."""
    size, reports = ring
    want = unsplit[name, size]["store"]
    assert want["hits"] >= 3 and want["extended"] >= 1 and want["misses"] >= 3  # the work found, extended, computed
    for report in reports:
        assert report["prefix_store"][name] == want


def test_every_rank_computed_and_only_the_last_sampled(ring):
    size, reports = ring
    assert all(r["clock"].busy > 0 for r in reports)
    assert all(r["clock"].micros == 0 for r in reports[:-1])
    assert reports[-1]["clock"].micros > 0
    assert all(r["clock"].wait > 0 for r in reports)  # rank 0 waited on the ids coming back, the others on hidden states


def _stored_fewshot(models) -> object:
    """The unsplit model, its prefix store holding `_fewshot`'s prefixes (micro_parts then runs no prefix pass)."""
    lm = load(str(models["stories"]))
    run(lm, Job(kind="generate"), _fewshot(False), Batching())
    return lm


def test_at_least_k_micro_batches_where_there_are_rows(models):
    lm = _stored_fewshot(models)
    for requests in (_requests(False), _fewshot(False)):
        for size in (2, 3):
            for batch in (1, 3, 4, 16):
                reqs, batches = decode.micro_parts(lm, requests, Batching(batch_size=batch), size)
                rows = [[i for _, _, idx in parts for i in idx] for parts in batches]
                assert len(rows) >= size and max(map(len, rows)) <= batch
                assert sorted(i for idx in rows for i in idx) == [i for i, r in enumerate(reqs) if r.max_gen_toks > 0]


def test_small_families_share_a_micro_batch(models):
    """The micro-batches the ring runs for `_fewshot` at the default batch size: some join two families' parts
    (their prefill round runs a forward each), and the prefixes are the families' (48, 36 and 41 tokens)."""
    lm = _stored_fewshot(models)
    for size in (2, 3):
        _, batches = decode.micro_parts(lm, _fewshot(False), Batching(), size)
        assert any(sum(kv is not None for kv, _, _ in parts) >= 2 for parts in batches)
        assert sorted({prefix for parts in batches for _, prefix, _ in parts}) == [0, 36, 41, 48]
