"""Grids of steering configurations (worker.grid, `run_grid` on both executors).

The shared path gives every configuration the numbers of an independent steered run, on several
architectures, with and without shared-prefix families, and really runs each unsteered block once and each
configuration only the blocks from its split up; every position rule at both sites, under shared few-shot
prefixes and left truncation, gives each request's numbers and texts run on its own; a model
where the mechanism does not hold falls back to independent runs; Ray on 1 and 3 workers equals the in-process
grid; grid cells land in the result cache under the keys `run` uses.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from driver.lm.cache import grid_keys, job_prefix, key
from driver.lm.local import LocalExecutor
from worker.generate import GenRequest
from worker.grid import GRID_BLOCK, grid_generate, grid_loglikelihood, shares_lower, split_point
from worker.hooks import decoder_layers
from worker.jobs import run
from worker.load import fingerprint, load
from worker.spec import Batching, Intervention, Job, ModelSpec, Steering

HIDDEN, LAYERS, MAX_LENGTH = 64, 4, 128
ARCHS = ("llama", "gpt2", "gemma", "mixtral")
TOL = 1e-5


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    from testbed.models import write_model

    root = tmp_path_factory.mktemp("grid-models")
    return {a: write_model(root / a, arch=a, hidden=HIDDEN, layers=LAYERS, heads=4) for a in ARCHS}


@pytest.fixture(scope="module")
def models(paths):
    return {a: load(ModelSpec(model=str(p), max_length=MAX_LENGTH)) for a, p in paths.items()}


def vector(seed: int) -> tuple[float, ...]:
    return tuple(np.random.default_rng(seed).standard_normal(HIDDEN).tolist())


def add(layer: int, alpha: float, **kw) -> Steering:
    return Steering(interventions=(Intervention(layer=layer, vector=vector(layer % LAYERS), alpha=alpha, **kw),))


def small_grid() -> list[Steering]:
    """A baseline, layers x alphas, and other ops, sites and positions (two interventions in one)."""
    grid = [Steering()] + [add(layer, alpha) for layer in (1, 2, -1) for alpha in (-2.0, 4.0)]
    grid.append(Steering(interventions=(Intervention(layer=2, site="resid_pre", op="clamp", vector=vector(9), alpha=0.5, positions="prompt"),)))
    grid.append(Steering(interventions=(Intervention(layer=3, op="ablate", vector=vector(8), positions="last"),)))
    grid.append(
        Steering(
            interventions=(
                Intervention(layer=2, op="replace", vector=vector(7), alpha=0.3, positions="continuation"),
                Intervention(layer=3, site="resid_pre", vector=vector(6), alpha=-1.0),
            )
        )
    )
    return grid


def requests(seed: int = 0, questions: int = 6) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Multiple-choice-like pairs: a 40-token shared few-shot prefix (a prefix family), rows sharing a context,
    an empty continuation and a short unrelated request."""
    rng = np.random.default_rng(seed)
    prefix = [1, *rng.integers(3, 300, 40).tolist()]
    out = []
    for _ in range(questions):
        ctx = tuple(prefix + rng.integers(3, 300, int(rng.integers(2, 9))).tolist())
        for _ in range(3):
            out.append((ctx, tuple(rng.integers(3, 300, int(rng.integers(1, 4))).tolist())))
    out += [((1, 5), ()), ((1, 5, 6), (7, 8))]
    return out


def independent(lm, steerings, reqs, batching) -> list[list]:
    """[configuration][request]: one plain steered run per configuration."""
    return [run(lm, Job(kind="loglikelihood", steering=s), reqs, batching) for s in steerings]


def assert_close(grid, want, relative: bool = False) -> None:
    """grid [configuration][request] against the same shape: logprobs within TOL, greedy flags identical.

    `relative`: TOL x max(1, |logprob|), for other processes (other chunks, so other batch shapes, and the
    workers' BLAS), as tests/test_cluster.py compares perplexities; these random models' sums reach -50.
    """
    assert len(grid) == len(want)
    for c, (mine, theirs) in enumerate(zip(grid, want)):
        assert len(mine) == len(theirs)
        for i, (x, y) in enumerate(zip(mine, theirs)):
            tol = TOL * max(1.0, abs(y[0])) if relative else TOL
            assert abs(x[0] - y[0]) <= tol and bool(x[1]) == bool(y[1]), (c, i, x, y)


def transpose(per_request: list[list]) -> list[list]:
    return [list(col) for col in zip(*per_request)]


# --- worker.grid: the shared path ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefix_reuse", [True, False])
def test_shared_path_equals_independent_steered_runs(models, arch, prefix_reuse):
    lm = models[arch]
    batching = Batching(batch_size=4, max_batch_tokens=256, prefix_reuse=prefix_reuse)
    grid, reqs = small_grid(), requests()
    assert all(shares_lower(lm, s) for s in range(1, LAYERS + 1))  # these architectures take the shared path
    got = transpose(grid_loglikelihood(lm, grid, reqs, batching))
    want = independent(lm, grid, reqs, batching)
    assert_close(got, want)
    assert max(abs(a[0] - b[0]) for a, b in zip(want[0], want[1])) > 1e-3  # the steering does change numbers
    assert not lm.hooks.active and not any(getattr(b, "_orchard_staged", False) for b in decoder_layers(lm.model))


# --- every position rule and site, number by number against each request run on its own -------------------

SITES = ("resid_pre", "resid_post")


def rule_grid(positions: str) -> list[Steering]:
    """One position rule at every site of layers 1 and 2 of 4 (resid_post: split L + 1, the others L), and the
    baseline. A grid holding one rule only: another rule in the same grid cannot hide a bug of this one."""
    ivs = [Intervention(layer=layer, site=site, vector=vector(2 * layer + k), alpha=3.0, positions=positions)
           for layer in (1, 2) for k, site in enumerate(SITES)]  # fmt: skip
    return [Steering()] + [Steering(interventions=(iv,)) for iv in ivs]


def few_shot_requests(seed: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Two 40-token few-shot prefixes with three questions of two choices each (two prefix families), one input
    with three context/continuation boundaries, and two requests longer than MAX_LENGTH whose left-truncated
    inputs share a prefix (a family of their own)."""
    rng = np.random.default_rng(seed)
    ints = lambda n: tuple(rng.integers(3, 300, n).tolist())  # noqa: E731
    out = []
    for _ in range(2):
        prefix = (1, *ints(40))
        for _ in range(3):
            ctx = prefix + ints(int(rng.integers(2, 6)))
            out += [(ctx, ints(int(rng.integers(1, 4)))) for _ in range(2)]
    ctx, cont = out[0][0], ints(3)
    out += [(ctx, cont), (ctx + cont[:1], cont[1:]), (ctx + cont[:2], cont[2:])]
    long = ints(MAX_LENGTH + 20)
    out += [(long + ints(4), ints(3)) for _ in range(2)]
    return out


def window(request: tuple, max_length: int) -> tuple:
    """The request cut to what lm-eval's HF window feeds (ctx + cont)[-(max_length + 1):], the continuation
    whole: it then needs no truncation, so its reference owes nothing to the kernels' truncation code."""
    ctx, cont = request
    keep = max_length + 1 - len(cont)
    return (ctx[-keep:], cont) if len(ctx) > keep else request


def alone(lm, steering: Steering, reqs: list) -> list:
    """Each request on its own (one row, no shared prefix, no truncation) through the plain in-process path."""
    job = Job(kind="loglikelihood", steering=steering)
    return [run(lm, job, [window(r, lm.max_length)], Batching())[0] for r in reqs]


def gen_requests(seed: int) -> list[GenRequest]:
    """Few-shot-like prompts (one shared prefix, other lengths: other left pads) and one longer than the room."""
    rng = np.random.default_rng(seed)
    prefix = (1, *rng.integers(3, 300, 40).tolist())
    out = [GenRequest(context=prefix + tuple(rng.integers(3, 300, n).tolist()), max_gen_toks=5) for n in (2, 5, 9)]
    return out + [GenRequest(context=tuple(rng.integers(3, 300, MAX_LENGTH).tolist()), max_gen_toks=5)]


@pytest.mark.parametrize("positions", ["all", "prompt", "continuation", "last"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_position_rule_and_site_equals_each_request_run_alone(models, arch, positions):
    lm, grid = models[arch], rule_grid(positions)
    assert all(shares_lower(lm, split_point(s, LAYERS)) for s in grid[1:])  # the shared path, prefixes shared
    reqs = few_shot_requests(11)
    got = transpose(run(lm, Job(kind="loglikelihood", grid=tuple(grid)), reqs, Batching(batch_size=4, max_batch_tokens=256)))
    want = [alone(lm, s, reqs) for s in grid]
    assert_close(got, want, relative=True)
    for c in range(1, len(grid)):  # each configuration changes numbers (so each was really compared)
        assert max(abs(a[0] - b[0]) for a, b in zip(want[0], want[c])) > 1e-2, c
    gens = gen_requests(12)
    got = transpose(run(lm, Job(kind="generate", grid=tuple(grid)), gens, Batching(batch_size=4)))
    cut = [replace(g, context=g.context[-(MAX_LENGTH - g.max_gen_toks) :]) for g in gens]
    want = [[run(lm, Job(kind="generate", steering=s), [g], Batching())[0] for g in cut] for s in grid]
    assert got == want
    assert sum(w != want[0] for w in want[1:]) >= 2  # steering changed generated texts


def _count_block_calls(lm, monkeypatch) -> dict[int, int]:
    """Count real runs of each decoder block (a staged block that passes or injects does not run)."""
    calls: dict[int, int] = {}
    for block in decoder_layers(lm.model):
        cls = type(block)

        def __call__(self, *args, _cls=cls, **kwargs):
            calls[self._orchard_layer] = calls.get(self._orchard_layer, 0) + 1
            return _cls.__call__(self, *args, **kwargs)

        monkeypatch.setattr(block, "__class__", type(cls.__name__, (cls,), {"__call__": __call__}))
    return calls


@pytest.mark.parametrize("prefix_reuse", [True, False])
def test_unsteered_blocks_run_once_and_each_configuration_only_its_own(paths, monkeypatch, prefix_reuse):
    """Block i runs once unsteered (below the highest split) plus once per configuration steered below it."""
    lm = load(ModelSpec(model=str(paths["llama"]), max_length=MAX_LENGTH))
    batching = Batching(batch_size=4, max_batch_tokens=256, prefix_reuse=prefix_reuse)
    grid = [Steering(), add(1, 1.0, site="resid_pre")] + [add(layer, alpha) for layer in (1, 2, 3) for alpha in (1.0, 4.0)]
    splits = [split_point(s, LAYERS) for s in grid]
    assert sorted(set(splits)) == [1, 2, 3, 4] and all(shares_lower(lm, s) for s in splits)
    reqs = requests()
    calls = _count_block_calls(lm, monkeypatch)
    run(lm, Job(kind="loglikelihood"), reqs, batching)
    once = dict(calls)  # forwards of one plain run, per block
    calls.clear()
    grid_loglikelihood(lm, grid, reqs, batching)
    for i in range(LAYERS):
        assert calls[i] == once[i] * ((i < max(splits)) + sum(s <= i for s in splits)), i
    assert sum(calls.values()) < 0.5 * len(grid) * sum(once.values())  # vs one run per configuration


def test_split_point():
    assert split_point(Steering(), 4) == 4
    assert split_point(add(2, 1.0), 4) == 3
    assert split_point(add(-1, 1.0), 4) == 4
    assert split_point(add(2, 1.0, site="resid_pre"), 4) == 2
    for site in ("resid_mid", "attn_out", "mlp_out"):  # inside block 2: it runs under the configuration's hooks
        assert split_point(add(2, 1.0, site=site), 4) == 2
    both = Steering(interventions=add(3, 1.0).interventions + add(1, 1.0, site="resid_pre").interventions)
    assert split_point(both, 4) == 1


def test_more_configurations_than_one_block(models):
    lm = models["llama"]
    batching = Batching(batch_size=8)
    grid = [add(layer, float(a)) for a in range(GRID_BLOCK) for layer in (1, 3)] + [Steering(), add(1, 1.0)]  # a duplicate
    reqs = requests(3, questions=2)
    assert_close(transpose(run(lm, Job(kind="loglikelihood", grid=tuple(grid)), reqs, batching)), independent(lm, grid, reqs, batching))


class _Mixing:
    """A forward that reads a block's output besides feeding it to the next block (the first block's output
    is added to the last one's): the shared-state mechanism cannot hold, steering still does."""

    def __call__(self, inputs, cache=None, input_embeddings=None):
        from mlx_lm.models.base import create_attention_mask

        h = self.embed_tokens(inputs)
        cache = cache if cache is not None else [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        first = None
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
            first = h if first is None else first
        return self.norm(h + 0.5 * first)


def test_architecture_where_the_mechanism_fails_falls_back_to_independent_runs(paths):
    lm = load(ModelSpec(model=str(paths["llama"]), max_length=MAX_LENGTH))
    inner = lm.model.model
    inner.__class__ = type("MixingLlama", (_Mixing, type(inner)), {})
    # Split after block 0 the first output is still block 0's own; any higher split would inject it there.
    assert shares_lower(lm, 1) and not any(shares_lower(lm, s) for s in range(2, LAYERS + 1))
    batching = Batching(batch_size=4, max_batch_tokens=256)
    grid, reqs = small_grid(), requests(1)
    assert_close(transpose(grid_loglikelihood(lm, grid, reqs, batching)), independent(lm, grid, reqs, batching))


def test_generation_grid_equals_per_configuration_runs(models):
    lm = models["gpt2"]
    grid = [Steering(), add(1, 6.0), add(-1, -6.0, positions="last")]
    reqs = [GenRequest(context=(5, 17, 33, 90), max_gen_toks=6), GenRequest(context=(7, 8), max_gen_toks=4, do_sample=True, temperature=0.8, seed=3)]
    got = transpose(grid_generate(lm, grid, reqs, Batching(batch_size=2)))
    want = [run(lm, Job(kind="generate", steering=s), reqs, Batching(batch_size=2)) for s in grid]
    assert got == want and got[0] != got[1]


def test_local_executor_run_grid(paths):
    ex = LocalExecutor(ModelSpec(model=str(paths["gemma"]), max_length=MAX_LENGTH), Batching(batch_size=4))
    grid, reqs = small_grid()[:5], requests(2, questions=3)
    got = ex.run_grid("loglikelihood", grid, reqs)
    assert_close(got, [ex.run(Job(kind="loglikelihood", steering=s), reqs) for s in grid])
    with pytest.raises(ValueError, match="capture"):
        ex.run_grid("capture", grid, [])


# --- Job and keys -----------------------------------------------------------------------------------------


def test_grid_jobs_and_their_keys():
    s = add(1, 2.0)
    assert Job(kind="loglikelihood", steering=s).key() == Job(kind="loglikelihood", steering=s, grid=()).key()
    assert Job(kind="loglikelihood", grid=(s,)).key() != Job(kind="loglikelihood").key()
    for bad in (dict(kind="capture", grid=(s,)), dict(kind="loglikelihood", steering=s, grid=(s,))):
        with pytest.raises(ValueError, match="grid"):
            Job(**bad)
    ident, reqs = b"model-identity-16", requests(4, questions=1)
    keys = grid_keys(ident, "loglikelihood", [Steering(), s], reqs)
    assert keys == [[key(job_prefix(ident, Job(kind="loglikelihood", steering=g)), "loglikelihood", r) for r in reqs] for g in (Steering(), s)]
    gen = [GenRequest(context=(1, 2), max_gen_toks=3)]
    assert grid_keys(ident, "generate", [s], gen) == [[key(job_prefix(ident, Job(kind="generate", steering=s)), "generate", gen[0])]]


# --- the head: chunk planning (cluster.plan) ---------------------------------------------------------------


def _planner(workers: int, max_batch_tokens: int = 256) -> dict:
    return {"workers": workers, "n_layers": LAYERS, "max_batch_tokens": max_batch_tokens}  # as if every worker were ready


def _plan(planner, grid, reqs, done=()):
    from cluster.plan import grid_chunks, request_costs
    from cluster.schedule import Merge

    merges = [Merge(len(reqs)) for _ in grid]
    for c, i in done:
        merges[c].add([i], [None])
    costs, groups = request_costs("loglikelihood", reqs, MAX_LENGTH, Batching().prefix_reuse)
    chunks, chunk_costs = grid_chunks(grid, costs, groups, merges, **planner)
    assert len(chunk_costs) == len(chunks) and all(c >= 0 for c in chunk_costs)
    cells = [(c, i) for block, idx in chunks for c in block for i in idx]
    assert len(cells) == len(set(cells)) and set(cells) | set(done) == {(c, i) for c in range(len(grid)) for i in range(len(reqs))}
    return chunks


def test_chunks_cover_each_missing_cell_once_and_keep_workers_busy():
    reqs = requests(5, questions=2)  # one prefix family and two loose rows: few request chunks
    many = [add(layer, float(a)) for a in range(20) for layer in (1, 2)]
    chunks = _plan(_planner(4), many, reqs)
    assert len(chunks) >= 8 and max(len(b) for b, _ in chunks) <= GRID_BLOCK  # a large grid, a small task
    one = _plan(_planner(1), many[:10], reqs)
    assert all(len(b) == 10 for b, _ in one)  # one worker: every configuration shares each lower pass
    big = [(tuple(range(300)), (7,)) for _ in range(1)] + [((1, *range(10 + i, 80 + i)), (5, 6)) for i in range(200)]
    wide = _plan(_planner(4, 64), many[:6], big)
    assert all(len(b) == 6 for b, _ in wide) and len(wide) >= 8  # a small grid, a large task: requests split
    done = [(c, i) for c in range(3) for i in range(len(reqs))] + [(5, 0)]
    _plan(_planner(2), many[:8], reqs, done)  # a grown / resumed grid: only the missing cells


# --- Ray workers and the result cache ----------------------------------------------------------------------


def _ray_executor(path: Path, workers: int, cache_dir=None, files=None):
    from driver.lm.mlx_ray import ray_executor

    return ray_executor(
        ModelSpec(model=str(path), max_length=MAX_LENGTH),
        Batching(batch_size=4, max_batch_tokens=128),
        model_identity={"model": str(path), "max_length": MAX_LENGTH},
        max_length=MAX_LENGTH,
        workers=workers,
        cache_dir=cache_dir,
        files=files,
    )


@pytest.fixture(scope="module")
def in_process(paths):
    lm = load(ModelSpec(model=str(paths["llama"]), max_length=MAX_LENGTH))
    reqs = requests(6, questions=8) + requests(7, questions=4)
    grid = small_grid()
    gens = [GenRequest(context=(5, 17, 33, 90), max_gen_toks=5), GenRequest(context=(7, 8, 9), max_gen_toks=3)]
    b = Batching(batch_size=4, max_batch_tokens=128)
    return grid, reqs, gens, transpose(grid_loglikelihood(lm, grid, reqs, b)), transpose(grid_generate(lm, grid, gens, b))


@pytest.mark.parametrize("workers", [1, 3])
def test_run_grid_on_ray_workers_equals_the_in_process_grid(ray_cluster, paths, in_process, workers):
    grid, reqs, gens, want, want_gen = in_process
    ex = _ray_executor(paths["llama"], workers)
    try:
        got = ex.run_grid("loglikelihood", grid, reqs)
        got_gen = ex.run_grid("generate", grid, gens)
        info = ex.info()
    finally:
        ex.close()
    assert_close(got, want, relative=True)
    assert got_gen == want_gen
    assert info["workers"] == workers and sum(info["requests_computed"].values()) == len(grid) * (len(reqs) + len(gens))
    stores = info["prefix_store"]  # each worker's prefix KV store, asked after the work (the run summary's)
    assert len(stores) == workers and all(s["budget"] == 1 << 30 and s["peak_bytes"] <= s["budget"] for s in stores)
    assert sum(s["misses"] for s in stores) > 0  # the grid's sharers stored their prompts


def test_grid_cells_are_cached_under_the_keys_run_uses(ray_cluster, paths, in_process, tmp_path):
    grid, reqs, gens, want, want_gen = in_process
    cache = str(tmp_path / "cache")
    n, first = len(reqs), grid[:4]
    ex = _ray_executor(paths["llama"], 2, cache)
    try:
        computed = lambda: sum(ex.info()["requests_computed"].values())  # noqa: E731
        # A configuration run on its own first: the grid computes only the other cells.
        single = ex.run(Job(kind="loglikelihood", steering=first[1]), reqs)
        assert computed() == n
        got = ex.run_grid("loglikelihood", first, reqs)
        assert computed() == n + 3 * n and ex.info()["requests_cached"] == n
        assert_close(got, want[:4], relative=True)
        assert [list(x) for x in single] == [list(x) for x in got[1]]
        # Each configuration's plain run is now served entirely from the cache.
        for c, s in enumerate(first):
            before = ex.info()["requests_cached"]
            again = ex.run(Job(kind="loglikelihood", steering=s), reqs)
            assert ex.info()["requests_cached"] - before == n and computed() == 4 * n
            assert [list(x) for x in again] == [list(x) for x in got[c]]
        # A grown grid (new layers x alphas, new ops): only the new cells are computed.
        grown = ex.run_grid("loglikelihood", grid, reqs)
        assert computed() == 4 * n + (len(grid) - 4) * n
        assert_close(grown, want, relative=True)
        gen = ex.run_grid("generate", grid[:2], gens)
        assert gen == want_gen[:2]
        before = computed()
        assert ex.run(Job(kind="generate", steering=grid[1]), gens) == want_gen[1] and computed() == before
    finally:
        ex.close()
    # A fresh executor (a rerun of the whole sweep) that knows the model's files without asking a worker, as
    # `mlx-ray` does for a local model: the same keys as the workers' facts gave, nothing to compute, none started.
    ex = _ray_executor(paths["llama"], 1, cache, files={"weights": fingerprint(paths["llama"])})
    try:
        assert_close(ex.run_grid("loglikelihood", grid, reqs), want, relative=True)
        assert sum(ex.info()["requests_computed"].values()) == 0 and ex.info()["requests_cached"] == len(grid) * n
        assert ex.connection is None and ex.info()["workers"] == 0
    finally:
        ex.close()
