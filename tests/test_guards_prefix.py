"""Guards for the prefix KV store (worker.prefix_cache): each test fails on a one-line slip that once survived.

- a stored prefix shorter than the wanted one is extended, never returned as the whole (its KV would lack tokens);
- an intervention's alpha is part of the store's key (configurations differing only in alpha never share KV);
- a pipeline rank counts an entry as the whole model's KV (n_layers / its layers), so every rank evicts alike.

Real random llama from the session fixtures; the share arithmetic on plain KV caches.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from worker.generate import GenRequest, generate
from worker.jobs import run
from worker.load import load
from worker.prefix_cache import DEFAULT_BUDGET, fingerprint, prefix_kv, set_budget, store
from worker.score import MIN_SHARED_PREFIX, _prefix_cache
from worker.spec import Batching, Intervention, Job, Steering
from worker.steer import steered

SHOTS = tuple(range(5, 5 + 2 * MIN_SHARED_PREFIX))  # a long shared prompt head
FAMILY = [SHOTS + q for q in ((300, 301, 302), (310,), (320, 321))]


@pytest.fixture(scope="module")
def lm(llama_path):
    return load(str(llama_path))


@pytest.fixture()
def fresh(lm):
    """The model's store emptied, at its default budget, before and after the test."""
    set_budget(lm, DEFAULT_BUDGET)
    store(lm).clear()
    yield store(lm)
    set_budget(lm, DEFAULT_BUDGET)
    store(lm).clear()


def _same_kv(got: list, want: list) -> None:
    assert [c.offset for c in got] == [c.offset for c in want]
    for g, w in zip(got, want):
        n = w.offset
        assert mx.allclose(g.keys[..., :n, :], w.keys[..., :n, :], atol=1e-5).item()
        assert mx.allclose(g.values[..., :n, :], w.values[..., :n, :], atol=1e-5).item()


def test_a_stored_prefix_shorter_than_the_wanted_one_is_extended_not_taken_whole(lm, fresh):
    tokens = SHOTS + tuple(range(200, 220))
    prefix_kv(lm, tokens[: len(SHOTS)])  # stored: it covers the head of `tokens`, not all of it
    got = prefix_kv(lm, tokens)
    assert (fresh.hits, fresh.extended, fresh.misses) == (0, 1, 1)
    _same_kv(got, _prefix_cache(lm, tokens))  # every wanted token's KV, as computed from scratch
    again = prefix_kv(lm, tokens)  # now the whole is stored: a hit
    assert fresh.hits == 1
    _same_kv(again, _prefix_cache(lm, tokens))


def test_a_stored_entry_that_is_not_a_prefix_of_the_wanted_tokens_is_not_used(lm, fresh):
    tokens = SHOTS + tuple(range(200, 220))
    other = SHOTS[:10] + (999,) + SHOTS[11:]  # same length as SHOTS, one token differs
    prefix_kv(lm, other)
    got = prefix_kv(lm, tokens)
    assert (fresh.hits, fresh.extended, fresh.misses) == (0, 0, 2)
    _same_kv(got, _prefix_cache(lm, tokens))


def test_generation_on_a_store_holding_shorter_prefixes_equals_the_unshared_run(lm, fresh):
    """The first call stores the family's shared head; the second call's family shares a longer head that starts
    with it: its texts must equal generation with nothing shared."""
    first = [GenRequest(SHOTS + q, max_gen_toks=6) for q in ((300, 301), (310, 311))]
    longer = SHOTS + tuple(range(400, 410))
    second = [GenRequest(longer + q, max_gen_toks=6) for q in ((500, 501), (510,), (520, 521, 522))]
    generate(lm, first)
    got = generate(lm, second)
    assert fresh.extended >= 1  # the stored head was extended, not recomputed
    set_budget(lm, 0)
    assert got == generate(lm, second, prefix_reuse=False)


def _alpha_job(lm, alpha: float) -> Job:
    vector = tuple(float(x) for x in np.random.default_rng(1).standard_normal(lm.config["hidden_size"]))
    return Job(kind="generate", steering=Steering(interventions=(Intervention(layer=0, vector=vector, alpha=alpha),)))


def test_configurations_differing_only_in_alpha_never_share_prefix_kv(lm, fresh):
    reqs = [GenRequest(c, max_gen_toks=8) for c in FAMILY]
    prints = []
    for alpha in (3.0, -3.0):
        with steered(lm, _alpha_job(lm, alpha).steering):
            prints.append(fingerprint(lm.hooks))
    assert prints[0] != prints[1]
    shared = [list(run(lm, _alpha_job(lm, a), reqs, Batching())) for a in (3.0, -3.0)]
    assert fresh.hits == 0  # the second configuration found nothing of the first's
    set_budget(lm, 0)
    alone = [list(run(lm, _alpha_job(lm, a), reqs, Batching(prefix_cache_mb=0))) for a in (3.0, -3.0)]
    assert shared == alone and shared[0] != shared[1]


# --- a pipeline rank's share of an entry's bytes (plain KV caches) ----------------------------------------------


def _kv(layers: int) -> list:
    from mlx_lm.models.cache import KVCache

    out = []
    for _ in range(layers):
        c = KVCache()
        c.keys = c.values = mx.zeros((1, 2, 10, 8), mx.float32)  # 160 float32 each
        out.append(c)
    return out


LAYER_BYTES = 2 * 160 * 4


@pytest.mark.parametrize("layers", [(0, 3), (3, 5), (0, 5)])
def test_a_pipeline_rank_counts_an_entry_as_the_whole_models_kv(layers):
    rank = SimpleNamespace(model=SimpleNamespace(), group=object(), n_layers=5, layers=layers)
    s = store(rank)
    s.put("fp", (1, 2, 3), _kv(layers[1] - layers[0]))  # a rank's cache holds its own layers only
    assert s.nbytes == 5 * LAYER_BYTES  # the same on every rank of the group: they store and evict alike


def test_an_unsplit_model_counts_its_entries_own_bytes():
    whole = SimpleNamespace(model=SimpleNamespace(), group=None, n_layers=5, layers=(0, 5))
    s = store(whole)
    s.put("fp", (1, 2, 3), _kv(5))
    assert s.nbytes == 5 * LAYER_BYTES
