"""Sweeps share prompts across configurations in generation (issue 19, item 3).

Configurations that act alike on every prompt position (steering only `continuation` or `last` positions, or
none) compute each prompt's KV once (all but its last token, through worker.prefix_cache) and the others reuse
it; configurations that differ on prompt positions, even at one layer, never do. Configurations steering prompt
positions from block s up share the prompt's unsteered blocks below s (worker.grid.generation): each runs only
its own blocks on the prompt. Every configuration's texts, greedy and seeded-sampled, must equal its own
independent steered run. Real random MLX models.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from worker import cascade
from worker.generate import GenRequest, _prefill_copied, generate_tokens
from worker.grid import grid_generate, shares_lower
from worker.grid.generation import LOWER, staged_splits
from worker.hooks import decoder_layers
from worker.jobs import run
from worker.load import load
from worker.prefix_cache import prompt_prints, prompt_sharers, store
from worker.spec import Batching, Intervention, Job, ModelSpec, Steering
from worker.steer import hooks_for

HIDDEN, LAYERS, MAX_LENGTH = 64, 4, 160


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from testbed.models import write_model

    path = write_model(tmp_path_factory.mktemp("sweep-models") / "llama", arch="llama", hidden=HIDDEN, layers=LAYERS, heads=4)
    return load(ModelSpec(model=str(path), max_length=MAX_LENGTH))


def steer(layer: int, seed: int, alpha: float, positions: str, op: str = "add", site: str = "resid_post") -> Steering:
    vec = tuple(np.random.default_rng(seed).standard_normal(HIDDEN).tolist())
    return Steering(interventions=(Intervention(layer=layer, op=op, vector=vec, alpha=alpha, positions=positions, site=site),))


def prompts(seed: int) -> list[GenRequest]:
    """A few-shot family (a 40-token prefix, three questions), two loose prompts, greedy and seeded-sampled rows."""
    rng = np.random.default_rng(seed)
    ints = lambda n: tuple(rng.integers(3, 300, n).tolist())  # noqa: E731
    prefix = (1, *ints(40))
    ctxs = [prefix + ints(n) for n in (2, 5, 9)] + [ints(17), ints(6)]
    out = [GenRequest(c, max_gen_toks=6) for c in ctxs]
    return out + [GenRequest(c, max_gen_toks=6, do_sample=True, temperature=1.2, top_p=0.9, seed=i) for i, c in enumerate(ctxs)]


def independent(lm, grid, reqs, batching, kind: str = "generate") -> list[list]:
    """[request][configuration] from one plain steered job per configuration."""
    per_config = [run(lm, Job(kind=kind, steering=s), reqs, batching) for s in grid]
    return [list(r) for r in zip(*per_config)]


def counted_run(lm, grid, reqs, batching) -> tuple[list[list[str]], list[tuple[int, int]]]:
    """The grid's texts and the (rows, length) of every body forward it ran, the store emptied first (the model's
    one-time self-check runs before the counting)."""
    store(lm).clear()
    shapes = []
    cascade.usable(lm, _prefill_copied)

    def body(x, cache=None):
        shapes.append(tuple(x.shape[:2]))
        return lm.head.body(x, cache=cache)

    counted = dataclasses.replace(lm, head=dataclasses.replace(lm.head, body=body))
    return run(counted, Job(kind="generate", grid=tuple(grid)), reqs, batching), shapes


def computed_prompts(lm, grid, reqs, batching) -> tuple[list[list[str]], int]:
    """The grid's texts and the prompt tokens its forwards computed (rows x length of every multi-token body
    forward: prefills, prefix passes and their extensions; decode steps and one-token suffixes feed one)."""
    texts, shapes = counted_run(lm, grid, reqs, batching)
    return texts, sum(rows * length for rows, length in shapes if length > 1)


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
    assert prompt_sharers(lm, prompt_prints(lm, [hooks_for(s, LAYERS, HIDDEN) if s else [] for s in grid])) == [False, True, False, True]
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
        assert prompt_sharers(lm, prompt_prints(lm, installs), contexts, 4) == [True, True]
        set_budget(lm, need - 1)
        assert prompt_sharers(lm, prompt_prints(lm, installs), contexts, 4) == [False, False]
        assert grid_generate(lm, grid, reqs, batching) == independent(lm, grid, reqs, batching)
    finally:
        set_budget(lm, before)


# --- configurations alike on prompt positions decode side by side ---------------------------------------------


def decode_steps(lm, grid, reqs, batching) -> tuple[list[list[str]], int]:
    """The grid's texts and how many one-token forwards it ran (decode steps; last-token prefills)."""
    texts, shapes = counted_run(lm, grid, reqs, batching)
    return texts, sum(length == 1 for _, length in shapes)


ALIKE = [steer(0, 11, 3.0, "continuation", site="resid_pre"), steer(2, 12, 2.0, "last", "clamp", "mlp_out"),
         steer(1, 13, 0.5, "continuation", "replace", "attn_out"), Steering(), steer(3, 14, -3.0, "continuation")]


@pytest.mark.parametrize("rows", [None, 14])
def test_alike_configurations_decode_side_by_side_as_their_own_runs(lm, monkeypatch, rows):
    # Five configurations steering only continuation or last positions, at other sites, layers and ops: one decode
    # batch holds a row per (request, configuration) (with `rows` 14, two configurations a batch: runs of 2, 2, 1).
    # Rows end at different steps (max_gen_toks 2 to 9), a one-token prompt is prefilled whole under the rows' hooks.
    from worker.grid import generation

    if rows is not None:
        monkeypatch.setattr(generation, "SIDE_BY_SIDE_ROWS", rows)
    reqs = prompts(9) + [GenRequest((7,), max_gen_toks=2), GenRequest(prompts(9)[1].context, max_gen_toks=9)]
    batching = Batching(batch_size=6)
    ids = generate_tokens(lm, reqs[-1:])[0]  # the unsteered row stops at its third token's text, the others run on
    reqs[-1] = dataclasses.replace(reqs[-1], until=(lm.tokenizer.decode(ids[2:3]),))
    got, _ = decode_steps(lm, ALIKE, reqs, batching)
    assert got == independent(lm, ALIKE, reqs, batching)
    assert len(got[-1][3]) < min(len(got[-1][c]) for c in (0, 1, 2, 4))  # the unsteered row left its batch early
    assert sum(any(r[c] != r[3] for r in got) for c in (0, 1, 2, 4)) >= 3  # steering changed texts
    family = [r for r in reqs if r.context[0] == 1]  # 7 prompts after one prefix: one block of batch size 8
    width = generation.side_by_side_width(lm, family, 8)
    assert width >= 5 if rows is None else width == 2
    _, steps = decode_steps(lm, ALIKE, family, Batching(batch_size=8))
    _, two = decode_steps(lm, ALIKE[:2], family, Batching(batch_size=8))  # side by side too (one run of 2)
    assert steps < 1.3 * two if rows is None else steps > 2.5 * two  # one decode batch serves all five, or runs of 2, 2, 1


def test_a_forward_of_rows_side_by_side_must_say_whose_rows_they_are(lm):
    import mlx.core as mx

    from worker.hooks import Rows
    from worker.steer import SteeringError, side_by_side

    with lm.hooks.installed(side_by_side([hooks_for(ALIKE[0], LAYERS, HIDDEN)])), pytest.raises(SteeringError, match="configurations"):
        with lm.hooks.forward(Rows()):
            lm.model(mx.array([[1, 2]]))
    with lm.hooks.installed(side_by_side([[], hooks_for(steer(0, 1, 5.0, "all", site="resid_pre"), LAYERS, HIDDEN)])):
        with lm.hooks.rows_under([0, 1]), lm.hooks.forward(Rows()):
            out = lm.model(mx.array([[1, 2], [1, 2]]))
    plain = lm.model(mx.array([[1, 2]]))
    assert mx.array_equal(out[0], plain[0]).item() and not mx.allclose(out[1], plain[0]).item()  # row 1 only


# --- configurations steering prompt positions share the blocks below their split --------------------------


def layered_grid(positions: str) -> list[Steering]:
    """Two configurations per split: resid_pre.0 (split 0: nothing to share), resid_post.0 and resid_pre.1 (split
    1), resid_post.1 (2), resid_post.3 (4: every block's prompt KV is unsteered), and the baseline."""
    points = [(0, "resid_pre"), (0, "resid_post"), (1, "resid_pre"), (1, "resid_post"), (3, "resid_post")]
    grid = [steer(layer, 10 * layer + k, 3.0 - 5 * k, positions, site=site) for layer, site in points for k in (0, 1)]
    return [Steering(), *grid, steer(1, 5, 2.0, positions, "clamp", "resid_pre")]


def scoring_pairs(seed: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Target log-prob requests: the prompts as contexts, two targets each."""
    rng = np.random.default_rng(seed)
    return [(r.context, tuple(rng.integers(3, 300, n).tolist())) for r in prompts(seed) for n in (1, 3)]


@pytest.mark.parametrize("positions", ["all", "prompt", "continuation", "last"])
def test_sweep_at_every_layer_equals_independent_runs(lm, positions):
    grid, reqs, batching = layered_grid(positions), prompts(8), Batching(batch_size=4)
    got = run(lm, Job(kind="generate", grid=tuple(grid)), reqs, batching)
    assert got == independent(lm, grid, reqs, batching)
    assert sum(any(r[c] != r[0] for r in got) for c in range(1, len(grid))) >= 6  # steering changed texts
    if positions in ("all", "prompt"):  # the staged path ran for every split but 0
        installs = [hooks_for(s, LAYERS, HIDDEN) if s else [] for s in grid]
        contexts = [r.context for r in reqs]
        sharers = prompt_sharers(lm, prompt_prints(lm, installs), contexts, 4)  # the baseline's prompt KV is split 4's unsteered one
        assert staged_splits(lm, installs, sharers, contexts, 4) == [4, 0, 0, 1, 1, 1, 1, 2, 2, 4, 4, 1]
    pairs = scoring_pairs(9)
    scored = run(lm, Job(kind="loglikelihood", grid=tuple(grid)), pairs, batching)
    for mine, theirs in zip(scored, independent(lm, grid, pairs, batching, "loglikelihood")):
        assert all(abs(a[0] - b[0]) <= 1e-4 * max(1.0, abs(b[0])) and a[1] == b[1] for a, b in zip(mine, theirs))


def block_work(lm, monkeypatch) -> dict[int, int]:
    """Prompt tokens each decoder block really computes: rows x length of its multi-token forwards (a staged block
    that passes or injects computes nothing; decode steps and one-token suffixes feed one token)."""
    assert all(shares_lower(lm, s) for s in range(1, LAYERS + 1))  # probed (and memoized) before counting
    cascade.usable(lm, _prefill_copied)  # so is the model's one-time self-check
    work = dict.fromkeys(range(LAYERS), 0)
    for i, block in enumerate(decoder_layers(lm.model)):
        cls = type(block)

        def __call__(self, x, *args, _cls=cls, _i=i, **kwargs):
            work[_i] += x.shape[0] * x.shape[1] if x.shape[1] > 1 else 0
            return _cls.__call__(self, x, *args, **kwargs)

        monkeypatch.setattr(block, "__class__", type(cls.__name__, (cls,), {"__call__": __call__}))
    return work


def sweep_work(lm, work, grid, reqs, batching) -> tuple[list[list[str]], dict[int, int]]:
    """A grid job's texts and its prompt work per block, the store emptied first."""
    store(lm).clear()
    work.update(dict.fromkeys(work, 0))
    return run(lm, Job(kind="generate", grid=tuple(grid)), reqs, batching), dict(work)


@pytest.mark.parametrize("positions", ["all", "prompt"])
def test_prompt_work_below_the_split_does_not_grow_with_the_configurations(lm, monkeypatch, positions):
    reqs, batching = prompts(10), Batching(batch_size=4)
    grid = [steer(1, 20 + k, 4.0 - 3 * k, positions) for k in range(3)]  # resid_post.1: split 2
    work = block_work(lm, monkeypatch)
    two, w2 = sweep_work(lm, work, grid[:2], reqs, batching)
    three, w3 = sweep_work(lm, work, grid, reqs, batching)
    assert [r[:2] for r in three] == two and three == independent(lm, grid, reqs, batching)
    assert 0 < w2[0] == w3[0] <= sum(map(len, {r.context for r in reqs})) and w2[1] == w3[1]  # each prompt once
    assert all(w3[i] - w2[i] == w2[i] // 2 > 0 for i in (2, 3))  # blocks 2 and 3: every configuration its own


def test_splits_chain_each_block_runs_each_prompt_once_below_the_highest_split(lm, monkeypatch):
    # Two configurations at each of splits 1, 2 and 3 (resid_post.0, .1, .2). Split 2's lower entry runs on from
    # split 1's (block 1 only) and split 3's from split 2's (block 2 only): the unsteered lower passes compute each
    # prompt once per block, where unchained ones run block 0 three times and block 1 twice. Texts: independent runs'.
    from worker.grid import generation

    reqs, batching = prompts(11), Batching(batch_size=4)
    grid = [steer(layer, 40 + 2 * layer + k, 3.0 - 2 * k, "all") for layer in (0, 1, 2) for k in range(2)]
    work = block_work(lm, monkeypatch)
    got, chained = sweep_work(lm, work, grid, reqs, batching)
    monkeypatch.setattr(generation, "_lower_below", lambda st, s, tokens: None)
    again, unchained = sweep_work(lm, work, grid, reqs, batching)
    assert got == again == independent(lm, grid, reqs, batching)
    _, single = sweep_work(lm, work, grid[:2], reqs, batching)  # split 1 alone: one lower pass (block 0)
    assert chained[0] == single[0] > 0 and unchained[0] > chained[0]  # block 0 (no configuration runs it) once
    assert all(c <= u for c, u in zip(chained.values(), unchained.values())) and unchained[1] > chained[1]


def test_configurations_differing_at_one_layer_share_only_the_blocks_below_both(lm, monkeypatch):
    # a and b steer block 0's output alike (split 1) and block 2's input differently: block 0's prompt KV is one
    # (the store's unsteered lower entry), blocks 1.. are each one's own, and nothing at or above layer 2 is alike.
    def config(seed: int) -> Steering:
        ivs = steer(0, 30, 2.0, "all").interventions + steer(2, seed, 3.0, "all", site="resid_pre").interventions
        return Steering(interventions=ivs)

    a, b, c = config(31), config(32), config(33)
    reqs, batching = prompts(11), Batching(batch_size=4)
    work = block_work(lm, monkeypatch)
    got, w2 = sweep_work(lm, work, [a, b], reqs, batching)
    assert got == independent(lm, [a, b], reqs, batching) and any(r[0] != r[1] for r in got)
    entries = {}
    for (fp, tokens), (cache, _) in store(lm).entries.items():
        entries.setdefault(tokens, {})[fp] = cache
    pairs = [e for e in entries.values() if len(e) == 3]  # a's, b's and the split's unsteered lower entry
    assert len(pairs) == 1 and all(LOWER.format(1) in e for e in pairs)  # the few-shot prefix (rows' own: dropped)
    assert len(entries) == 1 + len({r.context for r in reqs})  # the rows' prompts: their lower entries only
    for e in pairs:
        (ka, x), (kb, y) = [(k, v) for k, v in e.items() if k != LOWER.format(1)]
        assert x[0] is y[0] is e[LOWER.format(1)][0][0]  # block 0: the one unsteered KV
        assert all(x[i] is not y[i] for i in range(1, LAYERS))
        assert not any(np.allclose(np.array(x[i].keys[..., : x[i].offset, :]), np.array(y[i].keys[..., : y[i].offset, :])) for i in (2, 3))
    _, w3 = sweep_work(lm, work, [a, b, c], reqs, batching)
    assert w2[0] == w3[0] and all(w3[i] - w2[i] == w2[i] // 2 > 0 for i in (1, 2, 3))
