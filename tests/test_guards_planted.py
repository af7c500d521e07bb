"""Guards for one-line slips planted in the prefix stores (issue 27, "tests that let real bugs through").

The issue's eight survivors (a stored prefix taken whole, alpha left out of the key, a pipeline rank's share
swapped, the hook manager's idle threshold, the fluency verdict's `and`, the largest change by |delta|,
`not_fluent` listing configurations with no verdict, a capture's zero rows sized by the hidden width) are each
failed by tests/test_guards_prefix, test_guards_hooks, test_guards_sweep and test_guards_capture (planted one at a
time, Dec 2026). What still survived a variant of the first is here:

- worker.grid.generation chains a split's unsteered prompt KV from a lower split's entry (`_lower_below`); an entry
  of a lower split that holds only a head of the tokens must not be taken as holding them all.

Real random llama from the session fixtures (2 layers: splits 1 and 2).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from worker.grid.generation import LOWER, lower_kv
from worker.load import load
from worker.prefix_cache import DEFAULT_BUDGET, set_budget, store
from worker.score import MIN_SHARED_PREFIX

SHOTS = tuple(range(5, 5 + 2 * MIN_SHARED_PREFIX))
TOKENS = SHOTS + tuple(range(200, 220))


@pytest.fixture(scope="module")
def lm(llama_path):
    return load(str(llama_path))


@pytest.fixture()
def fresh(lm):
    set_budget(lm, DEFAULT_BUDGET)
    store(lm).clear()
    yield store(lm)
    set_budget(lm, DEFAULT_BUDGET)
    store(lm).clear()


def _same(got: tuple, want: tuple) -> None:
    (gk, gh), (wk, wh) = got, want
    assert gh.shape == wh.shape and mx.allclose(gh, wh, atol=1e-5).item()
    assert [c.offset for c in gk] == [c.offset for c in wk]
    for g, w in zip(gk, wk):
        assert mx.allclose(g.keys[..., : w.offset, :], w.keys[..., : w.offset, :], atol=1e-5).item()
        assert mx.allclose(g.values[..., : w.offset, :], w.values[..., : w.offset, :], atol=1e-5).item()


def test_a_lower_splits_entry_for_a_head_of_the_tokens_is_not_taken_whole(lm, fresh):
    lower_kv(lm, 1, SHOTS)  # split 1's entry covers the head of TOKENS only
    assert fresh.longest(LOWER.format(1), TOKENS)[0] == len(SHOTS)
    got = lower_kv(lm, 2, TOKENS)
    fresh.clear()
    _same(got, lower_kv(lm, 2, TOKENS))  # as computed from nothing stored


def test_a_lower_splits_entry_for_the_very_tokens_is_chained(lm, fresh):
    lower_kv(lm, 1, TOKENS)
    got = lower_kv(lm, 2, TOKENS)
    assert (fresh.extended, fresh.misses) == (1, 1)  # split 2 ran on from split 1's entry: only block 1 ran
    fresh.clear()
    _same(got, lower_kv(lm, 2, TOKENS))
