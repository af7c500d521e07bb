"""Conditional steering (CAST, worker.hooks.condition) on the real TinyStories-260K model: each row of a batch of 16
mixed prompts is decided as IBM's activation-steering decides one prompt alone (re-implemented here in numpy from
its leash_layer.py), the rows that fire equal a plainly steered run of the batch and the others the unsteered run,
bitwise in float32, for loglikelihood and generation; the results say which rows fired."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from worker.generate import GenRequest
from worker.hooks import Rows
from worker.jobs import run
from worker.load import load
from worker.spec import Batching, Condition, Gate, Intervention, Job, ModelSpec, Steering, SteeringError

C_LAYER, S_LAYER, ALPHA = 2, 3, 6.0
PROMPTS = [
    "Once upon a time, there was a little girl named Lily.", "Tom had a dog.", "The sun was hot and the sky was blue.",
    "Sara saw a big cat. The cat was black and it liked milk.", "One day", "Ben went to the park with his mom and dad.",
    "The bird sang a happy song in the tree.", "Max ran fast.", "Lily and Ben played with a red ball all day long.",
    "Mom made a cake.", "It was raining outside, so Sara stayed inside and read a book.", "The fish swam.",
    "A little boy wanted a toy car for his birthday.", "The dog barked at the cat.", "Anna liked to draw.",
    "There was a big tree in the garden, and a little squirrel lived in it.",
]  # fmt: skip


@pytest.fixture(scope="module")
def lm(stories_path):
    return load(ModelSpec(model=str(stories_path)))


@pytest.fixture(scope="module")
def direction():
    return np.random.default_rng(7).standard_normal(64).astype(np.float32)


def ids(lm, text):
    return tuple(lm.tokenizer.encode(text))


def cast_rule(lm, tokens, c, layer, pool="mean"):
    """IBM's `_process_single_condition` for one prompt alone (batch 1): pool the input of `layer`, project with
    P = ger(c, c) / c.c, tanh, cosine (leash_layer.py, malleable_model.py), in numpy."""
    seen = []
    with lm.hooks.installed([(f"resid_pre.{layer}", lambda x, ctx: seen.append(x) or x)]), lm.hooks.forward(Rows()):
        mx.eval(lm.model(mx.array([tokens])))
    h = np.asarray(seen[0][0], dtype=np.float64)
    h = h.mean(axis=0) if pool == "mean" else h[-1]
    c = np.asarray(c, dtype=np.float64)
    projected = np.tanh((np.outer(c, c) / c.dot(c)) @ h)
    return float(h.dot(projected) / (np.linalg.norm(h) * np.linalg.norm(projected)))


def between(sims):
    """A threshold half-way across the widest gap near the median: half the rows above it, none close to it."""
    s = sorted(sims)
    gaps = [(s[i + 1] - s[i], i) for i in range(len(s) // 2 - 3, len(s) // 2 + 3)]
    _, i = max(gaps)
    return (s[i] + s[i + 1]) / 2


def steering(direction, condition=None):
    v = tuple(float(x) for x in np.random.default_rng(3).standard_normal(64))
    return Steering(interventions=(Intervention(layer=S_LAYER, vector=v, alpha=ALPHA, condition=condition),))


def gate(direction, threshold, compare="greater", pool="mean", layers=(C_LAYER,)):
    c = Condition(vector=tuple(map(float, direction)), layers=layers, threshold=threshold, compare=compare, pool=pool)
    return Gate(conditions=(c,))


@pytest.fixture(scope="module")
def sims(lm, direction):
    return [cast_rule(lm, ids(lm, p), direction, C_LAYER) for p in PROMPTS]


def requests(lm):
    return [(ids(lm, p), ids(lm, " The end.")) for p in PROMPTS]


def test_each_row_decided_as_cast_decides_it_alone(lm, direction, sims):
    threshold = between(sims)
    for compare in ("greater", "smaller"):
        out = run(lm, Job(kind="loglikelihood", steering=steering(direction, gate(direction, threshold, compare))),
                  requests(lm), Batching(batch_size=16))  # fmt: skip
        want = [(s > threshold) if compare == "greater" else (s < threshold) for s in sims]
        assert [r[2] for r in out] == want
        assert 4 <= sum(want) <= 12  # a mixed batch


def test_fired_rows_are_steered_bitwise_and_others_plain(lm, direction, sims):
    reqs, batching = requests(lm), Batching(batch_size=16)
    plain = run(lm, Job(kind="loglikelihood"), reqs, batching)
    steered = run(lm, Job(kind="loglikelihood", steering=steering(direction)), reqs, batching)
    cond = run(lm, Job(kind="loglikelihood", steering=steering(direction, gate(direction, between(sims)))), reqs, batching)
    assert sum(p[0] != s[0] for p, s in zip(plain, steered)) == len(reqs)  # steering changes every row
    for p, s, c in zip(plain, steered, cond):
        assert c[:2] == (list(s) if c[2] else list(p))


def test_generation_keeps_each_rows_decision(lm, direction, sims):
    reqs = [GenRequest(context=ids(lm, p), max_gen_toks=12) for p in PROMPTS]
    plain = run(lm, Job(kind="generate"), reqs, Batching(batch_size=16))
    steered = run(lm, Job(kind="generate", steering=steering(direction)), reqs, Batching(batch_size=16))
    cond = run(lm, Job(kind="generate", steering=steering(direction, gate(direction, between(sims)))), reqs, Batching(batch_size=5))
    assert sum(p != s for p, s in zip(plain, steered)) >= 8
    assert [c[1] for c in cond] == [s > between(sims) for s in sims]
    assert [c[0] for c in cond] == [s if c[1] else p for p, s, c in zip(plain, steered, cond)]
