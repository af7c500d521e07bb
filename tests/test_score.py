"""The loglikelihood kernel against a plain one-request-at-a-time forward, and its invariances."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from worker.load import load
from worker.score import MIN_SHARED_PREFIX, families, loglikelihood
from worker.spec import Batching


@pytest.fixture(scope="module")
def lm(model_path):
    return load(str(model_path), max_length=96)


def reference(lm, ctx, cont):
    """One request, one full forward, every logit: the obviously-correct version (lm-eval HF rules)."""
    if not cont:
        return 0.0, True
    inp = (ctx + cont)[-(lm.max_length + 1) :][:-1]
    k = min(len(cont), len(inp))
    logits = lm.model(mx.array([inp]))[0].astype(mx.float32)
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True), dtype=np.float64)
    positions = range(len(inp) - k, len(inp))
    targets = cont[-k:]
    return (
        float(sum(logprobs[p, t] for p, t in zip(positions, targets))),
        all(int(np.argmax(logprobs[p])) == t for p, t in zip(positions, targets)),
    )


def make_requests(seed=0, vocab=700):
    """MMLU-like: a shared few-shot block, questions, 4 one-token answers each; plus odd shapes."""
    rng = np.random.default_rng(seed)
    ints = lambda n: [int(x) for x in rng.integers(3, vocab, n)]  # noqa: E731
    fewshot = [1] + ints(50)
    reqs = []
    for _ in range(12):
        ctx = fewshot + ints(int(rng.integers(3, 25)))
        reqs += [(ctx, ints(1)) for _ in range(4)]
        reqs.append((ctx, ints(3)))  # multi-token continuation on the same context
    reqs += [
        ([1, 5], ints(4)),
        ([1], ints(1)),
        (ints(200), ints(2)),  # context longer than the window: left-truncated
        ([1] * 5, ints(150)),  # continuation longer than the window: its last max_length tokens
        ([1, 2, 3], []),  # empty continuation
        (ints(60), ints(30)),
    ]
    return reqs


def test_matches_one_forward_per_request(lm):
    reqs = make_requests()
    got = loglikelihood(lm, reqs)
    for (ctx, cont), (lp, greedy) in zip(reqs, got):
        ref_lp, ref_greedy = reference(lm, ctx, cont)
        assert lp == pytest.approx(ref_lp, abs=1e-4 + 1e-6 * abs(ref_lp))
        assert greedy == ref_greedy
    assert got[-2] == (0.0, True)


@pytest.mark.parametrize(
    "batching",
    [Batching(batch_size=1), Batching(batch_size=8), Batching(batch_size=32), Batching(prefix_reuse=False), Batching(max_batch_tokens=64)],
    ids=["bs1", "bs8", "bs32", "no-prefix-reuse", "tight-token-budget"],
)
def test_batch_size_and_prefix_reuse_do_not_change_numbers(lm, batching):
    reqs = make_requests(seed=1)
    base = loglikelihood(lm, reqs, Batching(batch_size=32))
    got = loglikelihood(lm, reqs, batching)
    for (a, ga), (b, gb) in zip(got, base):
        assert abs(a - b) <= 1e-5 + 1e-7 * abs(b)
        assert ga == gb


def test_families_keep_shared_inputs_and_prefixes_together(lm):
    reqs = make_requests()
    groups = families(reqs, lm.max_length)
    assert sorted(i for g in groups for i in g) == list(range(len(reqs)))
    # the 60 requests behind the shared few-shot block form one family
    assert max(len(g) for g in groups) == 60
    assert families(reqs, lm.max_length, reuse=False) != groups
    # identical inputs are never split, even without prefix reuse
    for g in families(reqs, lm.max_length, reuse=False):
        ctxs = {tuple(reqs[i][0] + reqs[i][1][:-1]) for i in g}
        assert len(ctxs) == 1 or len(g) == 1


def test_short_shared_prefix_is_not_worth_a_pass(lm):
    reqs = [([1] * (MIN_SHARED_PREFIX - 1) + [5 + i], [7]) for i in range(4)]
    assert sorted(map(len, families(reqs, lm.max_length))) == [1, 1, 1, 1]


def test_request_without_any_context_token_is_refused(lm):
    with pytest.raises(ValueError, match="no context token"):
        loglikelihood(lm, [([], [5])])


def test_qwen2_family_scores_like_its_plain_forward(tmp_path):
    """A third architecture (attention biases, qwen2 block): same kernel, same reference."""
    from mlx_lm.utils import load as mlx_load

    from testbed.models import write_model

    path = write_model(tmp_path / "qwen2", arch="qwen2")
    lm = load(str(path), max_length=96)
    plain, _ = mlx_load(str(path))
    x = mx.array([[1, 40, 300, 7, 99]])
    assert mx.array_equal(plain(x), lm.model(x)).item()
    reqs = make_requests(seed=2)[:20]
    for (ctx, cont), (lp, greedy) in zip(reqs, loglikelihood(lm, reqs)):
        ref_lp, ref_greedy = reference(lm, ctx, cont)
        assert lp == pytest.approx(ref_lp, abs=1e-4) and greedy == ref_greedy
