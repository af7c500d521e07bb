"""Worker groups (issue 17): a model split over a REAL mx.distributed ring of 2 local processes (127.0.0.1, no
Ray) gives the unsplit model's numbers on every request kind, pipeline and tensor.

One ring per split kind runs every job on two models (the shipped TinyStories-260K, a llama with 5 layers and 8
heads, and a generated 4-layer qwen2); the test compares its ranks' results with the same jobs run unsplit here.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from testbed.ring import ROOT, by_model, pipeline_models, run_split
from worker.generate import GenRequest
from worker.jobs import run
from worker.load import load
from worker.spec import Batching, Grouping, Intervention, Job, Steering
from worker.split import check, free_address, layer_ranges
from worker.split.plan import head_layers, pipeline_ranges

TOLERANCE = {"pipeline": 1e-5, "tensor": 1e-4}  # pipeline runs the same ops; tensor sums partial products
# pipeline over 2 ranks: stories (5 layers) 0-2 | 3-4, qwen2 (4 layers) 0-1 | 2-3; a layer on each side
SIDES = {"stories": (1, 3), "qwen2": (0, 2)}
HIDDEN = {"stories": 64, "qwen2": 64}


def _steer(layer: int, hidden: int, alpha: float = 4.0, positions: str = "all") -> Steering:
    vector = tuple(float(v) for v in np.random.default_rng(layer).standard_normal(hidden))
    return Steering(interventions=(Intervention(layer=layer, vector=vector, alpha=alpha, positions=positions),))


def _work(name: str) -> list[tuple[str, Job, list]]:
    """Every request kind on one model: (label, job, requests)."""
    ll = [([1, 5, 9, 20, 30, 31, 32], [40, 41]), ([1, 5, 9, 20, 30, 31, 32], [42]), ([1, 7, 8], [9]), ([1, 2], [3, 4, 5])]
    gen = [GenRequest(context=(1, 5, 9, 20), max_gen_toks=12), GenRequest(context=(1, 7, 8, 30, 31), max_gen_toks=8)]
    shots = tuple(range(3, 43))  # a 40-token few-shot prefix: its KV held once (worker.cascade), on every rank
    family = [GenRequest(context=shots + q, max_gen_toks=6) for q in ((50, 51), (60,), (70, 71, 72))]
    low, high = SIDES[name]
    points = (f"resid_post.{low}", f"resid_post.{high}", f"mlp_out.{high}")
    steer_low, steer_high = _steer(low, HIDDEN[name]), _steer(high, HIDDEN[name])
    return [
        ("loglikelihood", Job(kind="loglikelihood"), ll),
        ("generate", Job(kind="generate"), gen),
        ("steered_low", Job(kind="loglikelihood", steering=steer_low), ll),
        ("steered_high", Job(kind="loglikelihood", steering=steer_high), ll),
        ("steered_generate", Job(kind="generate", steering=steer_high), gen),
        ("capture", Job(kind="capture", points=points), [([1, 5, 9, 20], -1), ([1, 7, 8, 30, 31], 2)]),
        ("steered_capture", Job(kind="capture", steering=steer_low, points=points), [([1, 5, 9, 20], -1)]),
        ("grid", Job(kind="loglikelihood", grid=(Steering(), steer_low, steer_high)), ll),
        ("family_generate", Job(kind="generate"), family),
        ("side_by_side", Job(kind="generate", grid=(Steering(), _steer(low, HIDDEN[name], positions="continuation"),
                                                    _steer(high, HIDDEN[name], positions="last"))), family),
    ]


CONFIGS: dict = {}  # each model's config.json (pipeline_models fills it)


@pytest.fixture(scope="module")
def models(stories_path, tmp_path_factory):
    return pipeline_models(stories_path, tmp_path_factory.mktemp("split"), CONFIGS)


@pytest.fixture(scope="module")
def unsplit(models):
    out = {}
    for name, folder in models.items():
        lm = load(str(folder))
        out[name] = {label: list(run(lm, job, requests, Batching())) for label, job, requests in _work(name)}
    return out


@pytest.fixture(scope="module", params=["pipeline", "tensor"])
def ring(request, models):
    """(split, each rank's report {layers, results: {model: {label: results}}}) from one ring of 2 processes."""
    work = [(name, job, requests) for name in models for _, job, requests in _work(name)]
    reports = run_split(models, Grouping(size=2, split=request.param), work, timeout=300)
    labels = [(name, label) for name in models for label, _, _ in _work(name)]
    return request.param, by_model(reports, labels)


def _scores(results) -> np.ndarray:
    assert not isinstance(results, str), results
    return np.array([lp for lp, _ in results])


@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_layers_owned(ring, models, name):
    split, reports = ring
    n = {"stories": 5, "qwen2": 4}[name]
    want = pipeline_ranges(CONFIGS[name], 2) if split == "pipeline" else [(0, n), (0, n)]
    assert [tuple(r["layers"][name]) for r in reports] == want
    if name == "qwen2" and split == "pipeline":  # its head (vocab 1024 x hidden 64) costs ~1.8 of its layers
        assert want == [(0, 3), (3, 4)]


@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_each_rank_holds_only_its_share(ring, models, name):
    from testbed.ring import weights_held

    whole = weights_held(load(str(models[name])))
    held = [r["weights_bytes"][name] for r in ring[1]]
    assert all(h < whole for h in held), (held, whole)
    assert sum(held) >= whole * 0.99  # nothing lost; pipeline repeats embeddings, norm and head on each rank


@pytest.mark.parametrize("label", ["loglikelihood", "steered_low", "steered_high"])
@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_loglikelihood_equals_unsplit(ring, unsplit, name, label):
    split, reports = ring
    want = unsplit[name][label]
    if split == "pipeline":  # pipelined (issue 26): the last rank alone runs the head and answers
        assert all(r["results"][name][label] == [None] * len(want) for r in reports[:-1])
        reports = reports[-1:]
    for report in reports:  # tensor: every rank computes the same logits; rank 0 returns them
        got = report["results"][name][label]
        assert np.abs(_scores(got) - _scores(want)).max() <= TOLERANCE[split]
        assert [g for _, g in got] == [g for _, g in want]
    if label != "loglikelihood":  # the steering changed the numbers: the hook ran on its layer's rank
        assert np.abs(_scores(want) - _scores(unsplit[name]["loglikelihood"])).max() > 1e-3


@pytest.mark.parametrize("label", ["generate", "steered_generate", "family_generate", "side_by_side"])
@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_greedy_generation_identical(ring, unsplit, name, label):
    split, reports = ring
    want = unsplit[name][label]
    if split == "pipeline":  # pipelined (worker.split.decode, worker.grid.pipelined): the last rank answers
        none = [[None] * len(w) for w in want] if label == "side_by_side" else [None] * len(want)
        assert all(r["results"][name][label] == none for r in reports[:-1])
        reports = reports[-1:]
    assert all(r["results"][name][label] == want for r in reports)


@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_every_rank_reads_a_shared_prefix_once(ring, unsplit, name):
    # Each rank passed worker.cascade's self-check (in lockstep), so the family and the sweep ran on one copy of the
    # prefix; the sweep's three configurations (alike on prompt positions: one prefix KV) gave three different texts.
    assert [r["cascade"][name] for r in ring[1]] == [True, True]
    assert any(len(set(per_config)) == 3 for per_config in unsplit[name]["side_by_side"])


@pytest.mark.parametrize("label", ["capture", "steered_capture"])
@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_capture_equals_unsplit(ring, unsplit, name, label):
    split, reports = ring
    if split == "pipeline":  # pipelined (issue 26): the rows ride forward to the last rank, which answers
        assert all(r["results"][name][label] == [None] * len(unsplit[name][label]) for r in reports[:-1])
        reports = reports[-1:]
    for report in reports:
        got = report["results"][name][label]
        assert not isinstance(got, str), got
        for g, w in zip(got, unsplit[name][label], strict=True):
            assert g.shape == w.shape
            assert np.abs(g - w).max() <= TOLERANCE[split] * max(1.0, float(np.abs(w).max()))


@pytest.mark.parametrize("name", ["stories", "qwen2"])
def test_grid_equals_unsplit(ring, unsplit, name):
    split, reports = ring
    want = unsplit[name]["grid"]
    if split == "pipeline":  # pipelined (worker.grid.pipelined): the last rank answers
        assert all(r["results"][name]["grid"] == [[None] * len(w) for w in want] for r in reports[:-1])
        reports = reports[-1:]
    for report in reports:
        got = report["results"][name]["grid"]
        assert not isinstance(got, str), got
        for g, w in zip(got, want, strict=True):
            assert np.abs(np.array([lp for lp, _ in g]) - np.array([lp for lp, _ in w])).max() <= TOLERANCE[split]


# --- bad splits, before anything loads (pure) ------------------------------------------------------------


def test_check_names_bad_splits(stories_path):
    config = json.loads((stories_path / "config.json").read_text())  # llama: 5 layers, 8 heads, 4 kv heads
    assert check(config, 2, "pipeline") is None and check(config, 4, "tensor") is None
    assert "larger than the model's 5 layers" in check(config, 6, "pipeline")
    assert "8 attention heads do not divide by group size 3" in check(config, 3, "tensor")
    assert "4 key/value heads do not divide by group size 8" in check(config, 8, "tensor")
    assert "--split pipeline" in check({"model_type": "gpt2", "n_layer": 2, "n_head": 4}, 2, "tensor")
    assert check({"model_type": "mistral", "num_hidden_layers": 2, "num_attention_heads": 4}, 2, "tensor") is None
    assert "below 1" in check(config, 0, "pipeline")
    for line in (check(config, 6, "pipeline"), check(config, 3, "tensor")):
        assert "\n" not in line


def test_layer_ranges_contiguous_low_ranks_take_extra():
    assert layer_ranges(5, 2) == [(0, 3), (3, 5)]
    assert layer_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert layer_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_layer_ranges_balance_the_head_and_the_embedding():
    """The busiest rank's cost (its layers, + embed on rank 0, + head on the last) is the least a split allows."""
    assert layer_ranges(8, 2, head=0.11) == [(0, 4), (4, 8)]  # the bench model: a head of 0.11 layers moves nothing
    assert layer_ranges(32, 2, head=2.4) == [(0, 17), (17, 32)]  # llama-3-8B's head: ~2.4 layers
    assert layer_ranges(8, 2, embed=2.0) == [(0, 3), (3, 8)]
    assert layer_ranges(12, 4, head=3.0) == [(0, 4), (4, 8), (8, 11), (11, 12)]
    assert layer_ranges(4, 2, head=1.8) == [(0, 3), (3, 4)]
    for n, k, head, embed in [(9, 3, 1.5, 0.5), (16, 4, 2.0, 1.0), (7, 2, 0.0, 0.0), (5, 5, 4.0, 0.0)]:
        ranges = layer_ranges(n, k, head, embed)
        assert ranges[0][0] == 0 and ranges[-1][1] == n and all(a < b for a, b in ranges)
        assert all(ranges[r][1] == ranges[r + 1][0] for r in range(k - 1))
        worst = max(b - a + embed * (r == 0) + head * (r == k - 1) for r, (a, b) in enumerate(ranges))
        splits = itertools.combinations(range(1, n), k - 1)  # every contiguous split: none has a lighter busiest rank
        best = min(max(b - a + embed * (r == 0) + head * (r == k - 1) for r, (a, b) in enumerate(zip((0, *c), (*c, n)))) for c in splits)
        assert worst == best


def test_head_layers_from_the_config():
    llama8b = {"hidden_size": 4096, "vocab_size": 128256, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    assert head_layers(llama8b) == pytest.approx(2.41, abs=0.01)
    assert head_layers({"num_hidden_layers": 4}) == 0.0  # nothing to go on: the plain split


def test_join_ends_a_rank_whose_ring_never_forms():
    """MLX's ring init holds the GIL and waits forever for a missing peer: join's watchdog ends the process within
    the timeout, with one line naming the rank."""
    hostfile = [free_address("127.0.0.1"), free_address("127.0.0.1")]
    code = f"from worker.split import join\njoin({hostfile!r}, 0, timeout=3)\nprint('joined')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == -9 and "joined" not in done.stdout
    assert done.stderr.strip() == (f"RingError: rank 0 ({hostfile[0]}): the ring of 2 did not form within 3 s: a rank "
                                   f"did not join or cannot reach another ({', '.join(hostfile)})")  # fmt: skip


def test_rank_in_a_ring_joins_and_sums():
    """Two processes form one ring over 127.0.0.1 and an all_sum pairs up (the smallest real ring)."""
    hostfile = [free_address("127.0.0.1"), free_address("127.0.0.1")]
    code = ("import sys, mlx.core as mx\nfrom worker.split import join\n"
            f"g = join({hostfile!r}, int(sys.argv[1]))\n"
            "print(g.rank(), g.size(), mx.distributed.all_sum(mx.array([g.rank() + 1.0]), group=g).item())")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], cwd=ROOT, stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert outs == [["0", "2", "3.0"], ["1", "2", "3.0"]]


def test_a_dead_peer_fails_a_collective_at_once():
    """What the cluster relies on: a ring collective whose peer process died raises at once (it never hangs)."""
    hostfile = [free_address("127.0.0.1"), free_address("127.0.0.1")]
    code = ("import os, sys, time, mlx.core as mx\nfrom worker.split import join\n"
            f"g = join({hostfile!r}, int(sys.argv[1]))\n"
            "mx.eval(mx.distributed.all_sum(mx.ones(4), group=g))\n"
            "if g.rank() == 1:\n    os._exit(0)\ntime.sleep(1)\n"
            "try:\n    mx.eval(mx.distributed.all_sum(mx.ones(4), group=g))\nexcept RuntimeError as e:\n    print(e)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True) for r in (0, 1)]  # fmt: skip
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert outs[0].strip() == "[ring] connection to a peer was lost"
