"""Sweeps share prompts across configurations in generation (issue 19, item 3).

Configurations that act alike on every prompt position (steering only `continuation` or `last` positions, or
none) compute each prompt's KV once (all but its last token, through worker.prefix_cache) and the others reuse
it; configurations that differ on prompt positions, even at one layer, never do. Every configuration's texts,
greedy and seeded-sampled, must equal its own independent steered run. Real random MLX models.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from worker.generate import GenRequest
from worker.grid import grid_generate
from worker.jobs import run
from worker.load import load
from worker.prefix_cache import prompt_sharers, store
from worker.spec import Batching, Intervention, Job, ModelSpec, Steering
from worker.steer import hooks_for

HIDDEN, LAYERS, MAX_LENGTH = 64, 4, 160


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from testbed.models import write_model

    path = write_model(tmp_path_factory.mktemp("sweep-models") / "llama", arch="llama", hidden=HIDDEN, layers=LAYERS, heads=4)
    return load(ModelSpec(model=str(path), max_length=MAX_LENGTH))


def steer(layer: int, seed: int, alpha: float, positions: str, op: str = "add") -> Steering:
    vec = tuple(np.random.default_rng(seed).standard_normal(HIDDEN).tolist())
    return Steering(interventions=(Intervention(layer=layer, op=op, vector=vec, alpha=alpha, positions=positions),))


def prompts(seed: int) -> list[GenRequest]:
    """A few-shot family (a 40-token prefix, three questions), two loose prompts, greedy and seeded-sampled rows."""
    rng = np.random.default_rng(seed)
    ints = lambda n: tuple(rng.integers(3, 300, n).tolist())  # noqa: E731
    prefix = (1, *ints(40))
    ctxs = [prefix + ints(n) for n in (2, 5, 9)] + [ints(17), ints(6)]
    out = [GenRequest(c, max_gen_toks=6) for c in ctxs]
    return out + [GenRequest(c, max_gen_toks=6, do_sample=True, temperature=1.2, top_p=0.9, seed=i) for i, c in enumerate(ctxs)]


def independent(lm, grid, reqs, batching) -> list[list[str]]:
    """[request][configuration] from one plain steered job per configuration."""
    per_config = [run(lm, Job(kind="generate", steering=s), reqs, batching) for s in grid]
    return [list(r) for r in zip(*per_config)]


def computed_prompts(lm, grid, reqs, batching) -> tuple[list[list[str]], int]:
    """The grid's texts and the prompt tokens its forwards computed (rows x length of every multi-token body
    forward: prefills, prefix passes and their extensions; decode steps and one-token suffixes feed one)."""
    store(lm).clear()
    fed = []

    def body(x, cache=None):
        fed.append(x.shape[0] * x.shape[1] if x.shape[1] > 1 else 0)
        return lm.head.body(x, cache=cache)

    counted = dataclasses.replace(lm, head=dataclasses.replace(lm.head, body=body))
    return run(counted, Job(kind="generate", grid=tuple(grid)), reqs, batching), sum(fed)


@pytest.mark.parametrize("batch_size", [3, 16])
def test_continuation_sweep_computes_each_prompt_once_and_equals_independent_runs(lm, batch_size):
    batching = Batching(batch_size=batch_size)
    grid = [Steering(), steer(1, 1, 4.0, "continuation"), steer(2, 2, -4.0, "continuation"), steer(3, 3, 1.0, "last", "ablate")]
    reqs = prompts(5)
    got, work = computed_prompts(lm, grid, reqs, batching)
    assert got == independent(lm, grid, reqs, batching)
    assert sum(any(r[c] != r[0] for r in got) for c in range(1, len(grid))) >= 2  # steering changed texts
    _, work_two = computed_prompts(lm, grid[:2], reqs, batching)
    assert work == work_two > 0  # prompt work does not grow with the configurations


def test_configurations_differing_at_one_layer_never_share_prompts(lm):
    # Two `all` configurations the same but for the vector at layer 2: each computes its own prompts; the
    # continuation ones share theirs.
    batching = Batching(batch_size=4)
    a, b = steer(2, 7, 3.0, "all"), steer(2, 8, 3.0, "all")
    grid = [a, steer(1, 1, 4.0, "continuation"), b, Steering()]
    assert prompt_sharers(lm, [hooks_for(s, LAYERS, HIDDEN) if s else [] for s in grid]) == [False, True, False, True]
    reqs = prompts(6)
    got = run(lm, Job(kind="generate", grid=tuple(grid)), reqs, batching)
    assert got == independent(lm, grid, reqs, batching)
    assert any(r[0] != r[2] for r in got)  # the two differ (so sharing between them would show)


def test_grid_generate_orders_results_by_configuration(lm):
    # Sharers run after the others, block by block: results still land in the given configuration order.
    grid = [steer(1, 1, 4.0, "continuation"), steer(2, 7, 3.0, "all"), Steering()]
    reqs = prompts(7)[:4]
    got = grid_generate(lm, grid, reqs, Batching(batch_size=2))
    assert got == independent(lm, grid, reqs, Batching(batch_size=2))


def test_prompts_are_not_shared_when_a_block_would_not_fit_the_store(lm):
    # A block of prompts whose KV exceeds the store's budget would be evicted before the next configuration
    # reads it (every configuration then recomputing each prompt row by row): configurations run on their own.
    from worker.prefix_cache import kv_bytes_per_token, set_budget

    grid = [Steering(), steer(1, 1, 4.0, "continuation")]
    reqs, batching = prompts(5), Batching(batch_size=4)
    installs = [hooks_for(s, LAYERS, HIDDEN) if s else [] for s in grid]
    contexts = [r.context for r in reqs]
    need = sum(sorted(map(len, contexts), reverse=True)[:4]) * kv_bytes_per_token(lm)
    before = store(lm).budget
    try:
        set_budget(lm, need)
        assert prompt_sharers(lm, installs, contexts, 4) == [True, True]
        set_budget(lm, need - 1)
        assert prompt_sharers(lm, installs, contexts, 4) == [False, False]
        assert grid_generate(lm, grid, reqs, batching) == independent(lm, grid, reqs, batching)
    finally:
        set_budget(lm, before)
