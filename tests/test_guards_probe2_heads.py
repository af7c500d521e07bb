"""Prefix sharing under attn_head steering (issue 29.6): a head's intervention is a known op to the prefix store.

- its fingerprint names the head (two heads never share KV; nor two alphas), so the store keeps entries and a
  later call of the same steering reads them, with texts equal to the store turned off;
- a head op at `continuation`/`last` positions never touches a prompt position: configurations that differ only
  there share each prompt's KV in a sweep (prompt_sharers);
- configurations steering one head of layer L share the prompt's unsteered blocks 0..L-1 (staged_splits).

Every case's texts equal each configuration's own run with nothing shared. Real random llama (4 layers, 4 heads).
"""

from __future__ import annotations

import numpy as np
import pytest

from worker.generate import GenRequest
from worker.grid import grid_generate
from worker.grid.generation import staged_splits
from worker.grid.passes import _installs
from worker.jobs import run
from worker.load import load
from worker.prefix_cache import DEFAULT_BUDGET, fingerprint, prompt_prints, prompt_sharers, set_budget, store
from worker.score import MIN_SHARED_PREFIX
from worker.spec import Batching, Intervention, Job, ModelSpec, Steering
from worker.steer import steered

HIDDEN, LAYERS, HEADS = 64, 4, 4
HEAD_DIM = HIDDEN // HEADS
SHOTS = tuple(range(5, 5 + 2 * MIN_SHARED_PREFIX))
REQS = [GenRequest(SHOTS + q, max_gen_toks=6) for q in ((300, 301, 302), (310,), (320, 321))]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from testbed.models import write_model

    path = write_model(tmp_path_factory.mktemp("head-models") / "llama", arch="llama", hidden=HIDDEN, layers=LAYERS, heads=HEADS)
    return load(ModelSpec(model=str(path), max_length=160))


@pytest.fixture()
def fresh(lm):
    set_budget(lm, DEFAULT_BUDGET)
    store(lm).clear()
    yield store(lm)
    set_budget(lm, DEFAULT_BUDGET)
    store(lm).clear()


def head(layer: int = 1, h: int = 2, alpha: float = 4.0, positions: str = "all", seed: int = 0) -> Steering:
    vec = tuple(np.random.default_rng(seed).standard_normal(HEAD_DIM).tolist())
    iv = Intervention(layer=layer, site="attn_head", head=h, vector=vec, alpha=alpha, positions=positions)
    return Steering(interventions=(iv,))


def alone(lm, grid, reqs) -> list[list[str]]:
    """[request][configuration], each configuration's own run with the store off."""
    set_budget(lm, 0)
    per = [run(lm, Job(kind="generate", steering=s), reqs, Batching(prefix_cache_mb=0)) for s in grid]
    set_budget(lm, DEFAULT_BUDGET)
    return [list(r) for r in zip(*per)]


def test_a_head_fingerprint_is_known_and_names_head_and_alpha(lm):
    prints = []
    for s in (head(), head(h=3), head(alpha=-4.0), head()):
        with steered(lm, s):
            prints.append(fingerprint(lm.hooks))
    assert None not in prints
    assert len(set(prints[:3])) == 3 and prints[0] == prints[3]


def test_a_head_steered_generation_stores_its_prefixes_and_reads_them_later(lm, fresh):
    job = Job(kind="generate", steering=head())
    first = list(run(lm, job, REQS[:2], Batching()))
    assert fresh.stats()["entries"] > 0  # the store is no longer empty under a head intervention
    later = list(run(lm, job, REQS, Batching()))
    assert fresh.hits + fresh.extended >= 1 and fresh.reused >= len(SHOTS)
    assert [first, later] == [[t[0] for t in alone(lm, [head()], REQS[:2])], [t[0] for t in alone(lm, [head()], REQS)]]


def test_head_configurations_differing_only_after_the_prompt_share_it(lm, fresh):
    grid = [head(positions="continuation", alpha=a) for a in (2.0, -3.0)] + [head(positions="last", h=1)]
    prints = prompt_prints(lm, _installs(lm, grid))
    assert prompt_sharers(lm, prints, [r.context for r in REQS], 2) == [True] * 3
    got = grid_generate(lm, grid, REQS, Batching(batch_size=2))
    assert fresh.reused > 0
    assert got == alone(lm, grid, REQS)


def test_head_configurations_of_one_layer_share_the_blocks_below_it(lm, fresh):
    grid = [head(layer=2, h=h, alpha=a) for h, a in ((0, 3.0), (3, -3.0))]
    installs = _installs(lm, grid)
    sharers = prompt_sharers(lm, prompt_prints(lm, installs), [r.context for r in REQS], 2)
    assert staged_splits(lm, installs, sharers, [r.context for r in REQS], 2) == [2, 2]
    got = grid_generate(lm, grid, REQS, Batching(batch_size=2))
    assert fresh.reused > 0
    assert got == alone(lm, grid, REQS)
