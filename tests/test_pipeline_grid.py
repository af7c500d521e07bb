"""Pipelined capture and grid jobs (issue 26.3) on REAL mx.distributed rings of K = 2 and 3 local processes
(127.0.0.1, no Ray): the last rank's captured rows (resid and attn_head points on every rank, a point on rank 0
only, under steering) equal the unsplit capture; a grid of configurations steering layers on every rank (one at a
rank's last layer, one on two ranks, one on continuation positions only) equals the unsplit grid and independent
steered runs, for loglikelihood (prefix families included) and greedy and seeded-sampled generation, on prompts
sharing a 40-token prefix too (its KV computed once per fingerprint on prompt positions, then found in the store).
Only the last rank holds numbers; no job calls a collective per batch (the hooks' idle check, once per job, is the
only one); the ranks past a capture's deepest point run no layers.

Models: the shipped TinyStories-260K (a llama of 5 layers: 3|2 over 2 ranks, 2|2|1 over 3) and a generated qwen2
of 4 layers (3|1 and 2|1|1): uneven layer counts on both.
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
from worker.split.schedule import rank_steps

CONFIGS: dict[str, dict] = {}  # each model's config.json: the split's layer plan is made from it
HIDDEN = 64


def _ranges(name: str, size: int) -> list[tuple[int, int]]:
    return pipeline_ranges(CONFIGS[name], size)


def _iv(layer: int, seed: int, **kw) -> Intervention:
    vector = tuple(np.random.default_rng(seed).standard_normal(HIDDEN).tolist())
    return Intervention(layer=layer, vector=vector, alpha=3.0, **kw)


def _grid(name: str, size: int) -> tuple[Steering, ...]:
    """Unsteered; each rank's first layer; a rank's last layer's resid_post (its split is the next rank's first
    layer); two layers on two ranks; each rank's first layer on continuation positions only (rows split there)."""
    ranges = _ranges(name, size)
    firsts = [start for start, _ in ranges]
    out = [Steering()] + [Steering(interventions=(_iv(layer, layer),)) for layer in firsts]
    out.append(Steering(interventions=(_iv(ranges[0][1] - 1, 50),)))
    out.append(Steering(interventions=(_iv(firsts[-1], 60), _iv(firsts[0], 61))))
    out.append(Steering(interventions=tuple(_iv(layer, 70 + layer, positions="continuation") for layer in firsts)))
    return tuple(out)


def _pairs() -> list:
    """Loglikelihood pairs: a family sharing a 40-token prefix (its prefix pass runs once per configuration), MMLU-like
    choices sharing a context, and loose pairs of several lengths."""
    rng = np.random.default_rng(11)
    shots = tuple(rng.integers(3, 200, 40).tolist())
    pairs = [(shots + (5, 6, i), (10 + i, 11)) for i in range(4)]
    context = tuple(rng.integers(3, 200, 12).tolist())
    pairs += [(context, (60 + i,)) for i in range(3)]
    pairs += [(tuple(rng.integers(3, 200, n).tolist()), tuple(rng.integers(3, 200, 3).tolist())) for n in (2, 7, 19, 30)]
    return pairs


def _prompts(sampled: bool) -> list[GenRequest]:
    """7 prompts sharing no prefix, stop strings on some, one with max_gen_toks 0; sampled ones with their own seeds."""
    rng = np.random.default_rng(5)
    out = []
    for i, n in enumerate([1, 17, 6, 11, 3, 9, 2]):
        settings = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=300 + i) if sampled else {}
        out.append(GenRequest(context=tuple(rng.integers(3, 250, n).tolist()), until=(".",) if i % 2 else (),
                              max_gen_toks=0 if i == 4 else 4 + i, **settings))  # fmt: skip
    return out


def _family_grid(name: str, size: int) -> tuple[Steering, ...]:
    """Unsteered; each rank's first layer at every position (its prefix KV differs on that rank and above: below it,
    a rank keeps one KV for it and the unsteered); the last rank's first layer again with continuation steering at
    rank 0 (alike on prompt positions: it reads the same prefix KV); each rank's first layer on continuation
    positions only (its prefix KV is the unsteered one)."""
    firsts = [start for start, _ in _ranges(name, size)]
    out = [Steering()] + [Steering(interventions=(_iv(layer, layer),)) for layer in firsts]
    out.append(Steering(interventions=(_iv(firsts[-1], firsts[-1]), _iv(firsts[0], 80, positions="continuation"))))
    out.append(Steering(interventions=tuple(_iv(layer, 70 + layer, positions="continuation") for layer in firsts)))
    return tuple(out)


def _family_prompts(sampled: bool, longer: bool = False) -> list[GenRequest]:
    """Two families of prompts sharing a 40-token prefix (`longer`: the same 40 and 4 more, 44), 4 and 3 rows with
    suffixes of several lengths, two loose prompts, stop strings on some, one with max_gen_toks 0; sampled ones
    with their own seeds."""
    rng = np.random.default_rng(8)
    heads = [tuple(rng.integers(3, 250, 40).tolist()) + (2, 2, 2, 2) * longer for _ in range(2)]
    contexts = [heads[0] + tuple(rng.integers(3, 250, n).tolist()) for n in (1, 6, 3, 9)]
    contexts += [heads[1] + tuple(rng.integers(3, 250, n).tolist()) for n in (2, 5, 1)]
    contexts += [tuple(rng.integers(3, 250, n).tolist()) for n in (7, 12)]
    out = []
    for i, context in enumerate(contexts):
        settings = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=400 + i) if sampled else {}
        out.append(GenRequest(context=context, until=(".",) if i % 3 == 1 else (), max_gen_toks=0 if i == 5 else 3 + i % 4,
                              **settings))  # fmt: skip
    return out


# label: (sampled, batching, the longer prefix: the store's 40-token entries extended); the store off last (its
# budget 0 empties it)
FAMILY_JOBS = {"family_greedy_b2": (False, Batching(batch_size=2), False),
               "family_greedy_b16": (False, Batching(), False),
               "family_sampled_b3": (True, Batching(batch_size=3), False),
               "family_sampled_b16": (True, Batching(), True),
               "family_greedy_no_store": (False, Batching(batch_size=3, prefix_cache_mb=0), False)}  # fmt: skip


def _captures(name: str, size: int) -> list[tuple]:
    ranges = _ranges(name, size)
    firsts = [start for start, _ in ranges]
    rng = np.random.default_rng(2)
    reqs = [(tuple(rng.integers(3, 200, n).tolist()), p) for n, p in ((9, -1), (4, 1), (17, -3), (9, 0), (30, 12), (6, -1))]
    reqs.append(reqs[0])  # the same tokens twice: one row
    resid = tuple(f"resid_pre.{layer}" for layer in firsts) + (f"resid_post.{ranges[-1][1] - 1}",)
    heads = tuple(f"attn_head.{layer}" for layer in firsts)
    steering = Steering(interventions=tuple(_iv(layer, 90 + layer) for layer in firsts))
    return [("capture_resid", Job(kind="capture", points=resid), reqs, Batching(batch_size=2)),
            ("capture_heads", Job(kind="capture", points=heads), reqs, Batching(batch_size=3)),
            ("capture_rank0", Job(kind="capture", points=("resid_post.0",)), reqs, Batching(batch_size=2)),
            ("capture_steered", Job(kind="capture", points=resid, steering=steering), reqs, Batching(batch_size=4))]  # fmt: skip


def _work(name: str, size: int) -> list[tuple]:
    """(label, job, requests, batching) on one model; generation grids on prompts sharing prefixes last (the first
    computes their prefix KV, the others find it in the store)."""
    grid, family = _grid(name, size), _family_grid(name, size)
    return _captures(name, size) + [
        ("grid_ll_b3", Job(kind="loglikelihood", grid=grid), _pairs(), Batching(batch_size=3)),
        ("grid_ll_b16", Job(kind="loglikelihood", grid=grid), _pairs(), Batching()),
        ("grid_greedy", Job(kind="generate", grid=grid), _prompts(False), Batching(batch_size=3)),
        ("grid_sampled", Job(kind="generate", grid=grid[:3]), _prompts(True), Batching(batch_size=4)),
    ] + [(label, Job(kind="generate", grid=family), _family_prompts(sampled, longer), batching)
         for label, (sampled, batching, longer) in FAMILY_JOBS.items()]  # fmt: skip


@pytest.fixture(scope="module")
def models(stories_path, tmp_path_factory):
    return pipeline_models(stories_path, tmp_path_factory.mktemp("pipegrid"), CONFIGS)


@pytest.fixture(scope="module")
def unsplit(models):
    """{(model, K): {label: results}} of the unsplit model, and each grid's configurations run one by one."""
    out = {}
    for name, folder in models.items():
        lm = load(str(folder))
        for size in (2, 3):
            got = out[name, size] = {label: list(run(lm, job, reqs, b)) for label, job, reqs, b in _work(name, size)}
            for label, job, reqs, b in _work(name, size):
                if job.grid:
                    got[label + "_alone"] = [list(run(lm, Job(kind=job.kind, steering=s), reqs, b)) for s in job.grid]
    return out


@pytest.fixture(scope="module", params=[2, 3])
def ring(request, models):
    """(K, each rank's report; its results, collectives, busy seconds, lookups, entries: {model: {label: ...}})."""
    size = request.param
    work = [(name, job, reqs, b) for name in models for _, job, reqs, b in _work(name, size)]
    reports = run_split(models, Grouping(size=size, split="pipeline"), work, timeout=600)
    labels = [(name, label) for name in models for label, *_ in _work(name, size)]
    by_model(reports, labels, ("results", "collectives", "busy", "lookups", "entries"))
    return size, reports


def _close(got, want) -> bool:
    return got.shape == want.shape and float(np.abs(got - want).max()) <= 1e-5 * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("label", ["capture_resid", "capture_heads", "capture_rank0", "capture_steered"])
@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_the_last_rank_captures_as_the_unsplit_model(ring, unsplit, name, label):
    size, reports = ring
    want, got = unsplit[name, size][label], reports[-1]["results"][name][label]
    assert not isinstance(got, str), got
    assert len(got) == len(want) and all(_close(g, w) for g, w in zip(got, want))
    for report in reports[:-1]:
        assert report["results"][name][label] == [None] * len(want)
    if label == "capture_steered":  # the steering on every rank's first layer changed what was captured
        assert max(float(np.abs(g - w).max()) for g, w in zip(got, unsplit[name, size]["capture_resid"])) > 1e-3


def _lls(results) -> np.ndarray:
    assert not isinstance(results, str), results
    return np.array([[lp for lp, _ in row] for row in results])


@pytest.mark.parametrize("label", ["grid_ll_b3", "grid_ll_b16"])
@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_a_scoring_grid_equals_the_unsplit_grid_and_independent_steered_runs(ring, unsplit, name, label):
    size, reports = ring
    want, got = unsplit[name, size][label], reports[-1]["results"][name][label]
    assert np.abs(_lls(got) - _lls(want)).max() <= 1e-5
    assert [[g for _, g in row] for row in got] == [[g for _, g in row] for row in want]
    alone = np.array([[lp for lp, _ in col] for col in unsplit[name, size][label + "_alone"]]).T
    assert np.abs(_lls(got) - alone).max() <= 1e-5
    scores = _lls(got)
    assert all(np.abs(scores[:, c] - scores[:, 0]).max() > 1e-3 for c in range(1, scores.shape[1]))  # each one steers
    assert reports[0]["results"][name][label] == [[None] * scores.shape[1]] * len(want)


@pytest.mark.parametrize("label", ["grid_greedy", "grid_sampled"])
@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_a_generation_grid_equals_the_unsplit_grid_and_independent_steered_runs(ring, unsplit, name, label):
    size, reports = ring
    want, got = unsplit[name, size][label], reports[-1]["results"][name][label]
    assert got == want
    assert [list(col) for col in zip(*got)] == unsplit[name, size][label + "_alone"]
    assert any(row[c] != row[0] for row in got for c in range(1, len(row)))  # the steering changed texts
    assert reports[0]["results"][name][label] == [[None] * len(want[0])] * len(want)


@pytest.mark.parametrize("label", list(FAMILY_JOBS))
@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_a_generation_grid_on_prompts_sharing_a_prefix_equals_the_unsplit_grid_and_independent_runs(ring, unsplit, name, label):
    size, reports = ring
    want, got = unsplit[name, size][label], reports[-1]["results"][name][label]
    assert got == want
    assert [list(col) for col in zip(*got)] == unsplit[name, size][label + "_alone"]
    plain = [row[0] for row in got]
    assert all(any(row[c] != p for row, p in zip(got, plain)) for c in range(1, len(got[0])))  # each one steers
    assert all(r["results"][name][label] == [[None] * len(want[0])] * len(want) for r in reports[:-1])


@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_a_prefix_is_computed_once_per_fingerprint_and_found_by_the_next_job(ring, name):
    """The family grid's 2 prefixes under its K + 1 fingerprints on prompt positions (the unsteered and the
    continuation ones share one, the two steering the last rank's first layer another): stored by the first job on
    every rank (as many lookups as a worker's), found whole by the next ones, or extended by 4 tokens (each pass on
    from its own fingerprint's entry); with the store off, none (each pass runs, nothing is stored)."""
    size, reports = ring
    passes = 2 * (size + 1)
    for report in reports:
        lookups = report["lookups"][name]
        want = {label: (0, passes, 0) if longer else (passes, 0, 0) for label, (_, _, longer) in FAMILY_JOBS.items()}
        want["family_greedy_b2"], want["family_greedy_no_store"] = (0, 0, passes), (0, 0, 0)
        assert {label: lookups[label] for label in FAMILY_JOBS} == want, lookups


@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_a_rank_keeps_one_prefix_kv_for_configurations_alike_on_its_layers(ring, name):
    """After the store's last family grid, every rank stores each prefix under the K + 1 fingerprints, and holds one
    KV per fingerprint of the hooks on its layers and below: the unsteered one, and one per rank's first layer at or
    below its own."""
    size, reports = ring
    firsts = [start for start, _ in _ranges(name, size)]
    for n, longer in ((40, False), (44, True)):
        heads = {r.context[:n] for r in _family_prompts(False, longer)}
        for report, (_, end) in zip(reports, _ranges(name, size)):
            held = [kv for tokens, kv in report["entries"][name]["family_sampled_b16"] if tokens in heads]
            assert len(held) == 2 * (size + 1)
            assert len(set(held)) == 2 * (1 + sum(first < end for first in firsts))


@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_no_collective_runs_per_batch_and_only_reached_ranks_compute(ring, name):
    """Capture and grid jobs (generation on prompts sharing a prefix too: nothing generate-kind stays lockstep on a
    pipeline group) call one collective per install of hooks (their idle check: worker.hooks.manager), once per job
    whatever the number of micro-batches (2 to 16 rows each here); the first to share a prefix also runs the
    model's one-off cascade self-check (worker.cascade.usable: 3 lockstep forwards, before the ring). A capture at
    layer 0 runs no layer past rank 0."""
    size, reports = ring
    first = next(iter(FAMILY_JOBS))
    for report in reports:
        counts = report["collectives"][name]
        want = {label: 2 if label == "capture_steered" else 1 for label in counts}  # steering, capture
        want[first] += 3
        assert counts == want, counts
    busy = [report["busy"][name] for report in reports]
    assert busy[0]["capture_rank0"] > 0 and all(b["capture_rank0"] == 0 for b in busy[1:])
    labels = ("capture_resid", "grid_ll_b3", "grid_greedy", *FAMILY_JOBS)
    assert all(b[label] > 0 for b in busy for label in labels)


def test_capture_with_sends_overlapped_keeps_its_rows(models, monkeypatch):
    """worker.split.stages.OVERLAP (each hidden-state send on a stream of its own): the rows sent after it still
    reach the next rank after it, K = 3."""
    monkeypatch.setenv("ORCHARD_PIPELINE_OVERLAP", "1")
    label, job, reqs, batching = _captures("stories", 3)[0]
    want = list(run(load(str(models["stories"])), job, reqs, batching))
    reports = run_split({"stories": models["stories"]}, Grouping(size=3, split="pipeline"), [("stories", job, reqs, batching)],
                        timeout=300)  # fmt: skip
    got = reports[-1]["results"][0]
    assert not isinstance(got, str), got
    assert all(_close(g, w) for g, w in zip(got, want, strict=True))
    assert all(r["overlap"] for r in reports)  # the setting reached every rank: the sends ran on their own stream


# --- the capture plan (worker.split.schedule.rank_steps with rows and reach), pure --------------------------------


@pytest.mark.parametrize("size,reach", [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2), (5, 2)])
def test_captured_rows_ride_to_the_last_rank_and_the_hidden_state_stops_at_the_reach(size, reach):
    micros = 4
    plans = [rank_steps(r, size, micros, rows=True, reach=reach) for r in range(size)]
    for r in range(size - 1):  # each link carries, in order per micro-batch, the hidden state (up to reach), then the rows
        sent = [(s.op, s.micro) for s in plans[r] if s.op in ("send", "send_rows")]
        got = [({"recv": "send", "recv_rows": "send_rows"}[s.op], s.micro) for s in plans[r + 1] if s.op in ("recv", "recv_rows")]
        assert sent == got == [(op, m) for m in range(micros) for op in (("send",) if r < reach else ()) + ("send_rows",)]
    for r, plan in enumerate(plans):
        assert [s.micro for s in plan if s.op == "forward"] == (list(range(micros)) if r <= reach else [])
        assert [s.micro for s in plan if s.op == "head"] == (list(range(micros)) if r == size - 1 else [])
    assert rank_steps(1, 3, 2) == rank_steps(1, 3, 2, rows=False, reach=2)  # scoring's plan: the defaults
    with pytest.raises(ValueError, match="reach 3 is outside a pipeline of 3"):
        rank_steps(0, 3, 2, reach=3)
