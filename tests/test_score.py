"""The loglikelihood kernel against a plain one-request-at-a-time forward, and its invariances."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from worker.load import load
from worker.score import MIN_SHARED_PREFIX, Row, _batches, _families, _rows, families, loglikelihood
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


def greedy_continuation(lm, ctx, n):
    """The model's own argmax tokens after ctx, in the window lm-eval gives a request of n continuation tokens."""
    start = max(0, len(ctx) + n - (lm.max_length + 1))
    toks = list(ctx)[start:]
    for _ in range(n):
        toks.append(int(mx.argmax(lm.model(mx.array([toks]))[0, -1]).item()))
    return toks[len(toks) - n :]


def runner_up(lm, ctx, cont, j):
    """cont with token j replaced by the second-best token at that position (so not greedy there)."""
    inp = (list(ctx) + list(cont))[-(lm.max_length + 1) :][:-1]
    p = len(inp) - len(cont) + j
    order = np.argsort(np.array(lm.model(mx.array([inp]))[0, p].astype(mx.float32)))
    return [*cont[:j], int(order[-2]), *cont[j + 1 :]]


@pytest.mark.parametrize("batching", [Batching(), Batching(batch_size=1, prefix_reuse=False), Batching(max_batch_tokens=64)])
def test_the_models_own_greedy_continuation_is_greedy(lm, batching):
    """is_greedy is True exactly where every continuation token is the argmax, next to rows where it is not."""
    reqs = make_requests(seed=3)
    mixed = []  # (index, expected is_greedy)
    # 0: a family member's input, shared with three random one-token answers; 4: a 3-token continuation of
    # the same question; 60: short context; 62: context cut to the window; 65: a long 30-token continuation.
    for i, n in [(0, 1), (4, 3), (60, 4), (62, 2), (65, 30)]:
        ctx = reqs[i][0]
        g = greedy_continuation(lm, ctx, n)
        mixed.append((len(reqs), True))
        reqs.append((ctx, g))
        for j in {0, n - 1}:  # the first or the last token not the argmax
            mixed.append((len(reqs), False))
            reqs.append((ctx, runner_up(lm, ctx, g, j)))
    got = loglikelihood(lm, reqs, batching)
    for i, expected in mixed:
        ref_lp, ref_greedy = reference(lm, *reqs[i])
        assert ref_greedy is expected
        assert got[i][1] is expected, i
        assert got[i][0] == pytest.approx(ref_lp, abs=1e-4 + 1e-6 * abs(ref_lp))
    assert [got[i][1] for i in range(5)] == [False] * 5  # the random answers next to the greedy one


@pytest.mark.parametrize(
    "batching",
    [Batching(batch_size=1), Batching(batch_size=8), Batching(batch_size=32), Batching(prefix_reuse=False), Batching(max_batch_tokens=64)],
    ids=["bs1", "bs8", "bs32", "no-prefix-reuse", "tight-token-budget"],
)
def test_batch_size_and_prefix_reuse_do_not_change_numbers(lm, batching):
    reqs = make_requests(seed=1)
    # The simplest schedule: one row per forward, no shared prefix.
    base = loglikelihood(lm, reqs, Batching(batch_size=1, prefix_reuse=False))
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
    # Exactly: question q's requests are 5q..5q+4 (four one-token answers sharing one input, then a 3-token
    # continuation); the six odd shapes after them (60..65) share nothing, and 64 is the empty continuation.
    odd = [[60], [61], [62], [63], [64], [65]]
    assert sorted(groups) == sorted([list(range(60)), *odd])
    # Without prefix reuse, identical inputs still stay together: the four answers of each question.
    no_reuse = families(reqs, lm.max_length, reuse=False)
    assert sorted(no_reuse) == sorted([g for q in range(12) for g in ([5 * q, 5 * q + 1, 5 * q + 2, 5 * q + 3], [5 * q + 4])] + odd)
    assert sorted(families(reqs, 30)) == sorted(no_reuse)  # a 30-token window: no 32-token prefix left to share


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


def _sizes(lengths, prefix=0, **batching):
    rows = [Row(tuple(range(n)), [], n) for n in lengths]
    out = _batches(rows, prefix, Batching(**batching))
    assert [len(r.tokens) for b in out for r in b] == sorted(lengths)  # every row once, shortest first
    return [len(b) for b in out]


def test_batches_respect_rows_tokens_and_padding_budgets():
    assert _sizes([10] * 8, batch_size=3) == [3, 3, 2]  # rows per forward
    assert _sizes([10] * 6, max_batch_tokens=25) == [2, 2, 2]  # padded suffix tokens per forward
    assert _sizes([10] * 6, max_batch_tokens=20) == [2, 2, 2]  # the budget itself is allowed
    # after a 90-token shared prefix each row adds 10 suffix tokens, but 100 attended: at most 4 * 100 / 100 rows
    assert _sizes([100] * 9, prefix=90, max_batch_tokens=100) == [4, 4, 1]
    assert _sizes([100] * 9, prefix=90, max_batch_tokens=1000) == [9]
    # padding: a fifth row of 12 after four of 10 would pad 60 tokens for 52 real ones (> 15% waste) ...
    assert _sizes([10, 10, 10, 10, 12]) == [4, 1]
    # ... one of 11 pads 55 for 51 (within 15%); below MIN_ROWS rows any padding is accepted
    assert _sizes([10, 10, 10, 10, 11]) == [5]
    assert _sizes([1, 1, 1, 40]) == [4]
    assert _sizes([19, 19, 19, 20, 20, 23]) == [6]  # exactly 15%: 6 x 23 = 138 = 1.15 x 120, still one forward
    # the waste is counted per forward: the first one's real tokens do not excuse the second one's pads
    assert _sizes([1] * 5 + [10, 10, 10, 10, 12], batch_size=5) == [5, 4, 1]
    assert _sizes([]) == []


def _forwards(lm, reqs, batching=None):
    """(results, tokens fed through the model body, shared-prefix passes) of one loglikelihood call."""
    import dataclasses

    fed, prefix_passes = [], []
    body = lm.head.body

    def counting(x, cache=None):
        fed.append(x.shape[0] * x.shape[1])
        if cache is not None and cache[0].offset == 0:  # a fresh cache: the prefix pass fills it
            prefix_passes.append(x.shape[1])
        return body(x, cache=cache)

    spy = dataclasses.replace(lm, head=dataclasses.replace(lm.head, body=counting))
    return loglikelihood(spy, reqs, batching), sum(fed), prefix_passes


def _fed_tokens(lm, reqs, batching):
    results, fed, _ = _forwards(lm, reqs, batching)
    return results, fed


def test_a_shared_prefix_runs_once(lm):
    reqs = make_requests()  # 12 questions x 2 inputs behind one 51-token few-shot block
    plain, without = _fed_tokens(lm, reqs, Batching(prefix_reuse=False))
    reused, with_reuse = _fed_tokens(lm, reqs, Batching())
    assert without - with_reuse >= 23 * 51 - 24 * 25  # 23 fewer copies of the block (less some extra padding)
    for (a, ga), (b, gb) in zip(reused, plain):
        assert abs(a - b) <= 1e-5 + 1e-7 * abs(b) and ga == gb
    # One prefix pass: the few-shot block (51 tokens, up to the first scored position of its shortest row); the
    # long single rows (first scored position >= 32) are not families of one.
    _, _, passes = _forwards(lm, reqs, Batching())
    assert len(passes) == 1 and passes[0] >= 51, passes
    assert _forwards(lm, reqs, Batching(prefix_reuse=False))[2] == []


def test_a_prefix_of_exactly_min_shared_tokens_is_shared(lm):
    shared = [1] + list(range(100, 100 + MIN_SHARED_PREFIX - 1))  # MIN_SHARED_PREFIX tokens
    reqs = [(shared + [7, 8], [9]), (shared + [10], [11, 12])]
    assert families(reqs, lm.max_length) == [[0, 1]]
    got, _, passes = _forwards(lm, reqs)
    assert passes == [MIN_SHARED_PREFIX]
    for (ctx, cont), (lp, greedy) in zip(reqs, got):
        ref_lp, ref_greedy = reference(lm, ctx, cont)
        assert lp == pytest.approx(ref_lp, abs=1e-4) and greedy == ref_greedy
    one_less = [(shared[1:] + [7, 8], [9]), (shared[1:] + [10], [11])]
    assert sorted(families(one_less, lm.max_length)) == [[0], [1]] and _forwards(lm, one_less)[2] == []


def test_same_input_with_another_context_boundary_shares_a_row(lm):
    ctx, cont = [1, 40, 50, 60, 70], [80, 90, 100]
    reqs = [(ctx, cont), (ctx + cont[:1], cont[1:]), (ctx + cont[:2], cont[2:])]
    assert families(reqs, lm.max_length, reuse=False) == [[0, 1, 2]]  # one input: one row, unsteered
    got, fed, _ = _forwards(lm, reqs)
    assert fed == len(ctx) + 2  # one forward of that input
    for (c, x), (lp, _) in zip(reqs, got):
        assert lp == pytest.approx(reference(lm, c, x)[0], abs=1e-4)


def test_prompt_and_continuation_positions_of_a_row(lm):
    """The Rows the kernel gives hooks: the context tokens are the prompt, fed continuation tokens follow."""
    seen = []

    def record(x, ctx):
        B, S, _ = x.shape
        seen.append((ctx.rows.mask("prompt", B, S).tolist(), ctx.rows.mask("continuation", B, S).tolist()))
        return x

    reqs = [([1, 40, 50, 60, 70], [80, 90, 100]), ([1, 41], [5])]
    with lm.hooks.installed([("resid_pre.0", record)]):
        loglikelihood(lm, reqs, Batching(prefix_reuse=False, batch_size=1))
    # the rows run shortest first: [1, 41] (prompt only), then the 5 + 2 tokens of the first request
    assert seen == [([[True, True]], [[False, False]]), ([[True] * 5 + [False] * 2], [[False] * 5 + [True] * 2])]


def test_sliding_window_model_scores_without_prefix_reuse(tmp_path):
    """Rotating KV caches cannot share a prefix: families fall back to full forwards, numbers unchanged."""
    import json

    from testbed.models import write_model

    path = write_model(tmp_path / "swa", arch="llama")
    config = json.loads((path / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    (path / "config.json").write_text(json.dumps(config))
    lm = load(str(path), max_length=96)
    reqs = make_requests()[:15] + make_requests()[60:64]
    got, _, passes = _forwards(lm, reqs)
    assert passes == []
    for (ctx, cont), (lp, greedy) in zip(reqs, got):
        ref_lp, ref_greedy = reference(lm, ctx, cont)
        assert lp == pytest.approx(ref_lp, abs=1e-4 + 1e-6 * abs(ref_lp)) and greedy == ref_greedy


@pytest.mark.parametrize("positions", ["all", "last", "prompt", "continuation"])
def test_steering_sees_the_same_positions_with_and_without_a_shared_prefix(lm, positions):
    from worker.steer import Add

    d = lm.config.get("hidden_size") or lm.config["n_embd"]
    add = Add(mx.random.normal((d,), key=mx.random.key(3)) * 2.0, positions=positions)
    full = make_requests()
    reqs = full[:20] + full[60:]  # four questions behind the few-shot block (one family), and the odd shapes
    plain = loglikelihood(lm, reqs)
    with lm.hooks.installed([("resid_post.0", add)]):
        reused = loglikelihood(lm, reqs, Batching())
        alone = loglikelihood(lm, reqs, Batching(prefix_reuse=False))
    for (a, ga), (b, gb) in zip(reused, alone):
        assert abs(a - b) <= 1e-4 + 1e-6 * abs(b) and ga == gb
    # Same input, other boundary between context and continuation: one row unsteered, two rows when the
    # steering tells prompt from continuation; each checked against a call of its own.
    ctx, cont = full[4]  # a 3-token continuation
    split = [(ctx, cont), (ctx + cont[:1], cont[1:]), (ctx + cont[:2], cont[2:])]
    with lm.hooks.installed([("resid_post.0", add)]):
        together = loglikelihood(lm, split)
        each = [loglikelihood(lm, [r])[0] for r in split]
    for (a, ga), (b, gb) in zip(together, each):
        assert abs(a - b) <= 1e-4 + 1e-6 * abs(b) and ga == gb
    # The steering did something wherever it has positions to act on: "continuation" only has the continuation
    # tokens fed as input, so one-token continuations keep their unsteered scores.
    acted = [i for i, (_, cont) in enumerate(reqs) if len(cont) > (1 if positions == "continuation" else 0)]
    moved = [abs(reused[i][0] - plain[i][0]) > 1e-3 for i in acted]
    assert sum(moved) > len(moved) // 2, positions
    if positions == "continuation":
        assert all(abs(reused[i][0] - plain[i][0]) <= 1e-4 for i in range(len(reqs)) if i not in acted)


@pytest.mark.parametrize("positions", ["prompt", "continuation"])
def test_steering_sees_the_prompt_boundary_of_the_left_truncated_input(lm, positions):
    """A request longer than the window is left-truncated: steering that tells prompt from continuation must
    see the boundary where the truncated input has it, i.e. give the numbers of the request cut to its window."""
    from worker.steer import Add

    d = lm.config.get("hidden_size") or lm.config["n_embd"]
    add = Add(mx.random.normal((d,), key=mx.random.key(5)) * 2.0, positions=positions)
    rng = np.random.default_rng(5)
    ints = lambda n: [int(x) for x in rng.integers(3, 700, n)]  # noqa: E731
    L, long = lm.max_length, ints(lm.max_length + 20)
    reqs = [(ints(L + 30), ints(3)), (ints(L + 1), ints(2)), (long + ints(3), ints(4)), (long + ints(3), ints(4))]
    cut = [(ctx[-(L + 1 - len(cont)) :], cont) for ctx, cont in reqs]  # fits the window: nothing to truncate
    assert all(len(c) + len(x) == L + 1 for c, x in cut) and _families(_rows(reqs, L)[0], True)[0].prefix
    plain = loglikelihood(lm, reqs)
    with lm.hooks.installed([("resid_post.0", add)]):
        got = loglikelihood(lm, reqs)
        want = [loglikelihood(lm, [r])[0] for r in cut]
    for (a, ga), (b, gb) in zip(got, want):
        assert abs(a - b) <= 1e-4 + 1e-6 * abs(b) and ga == gb
    assert all(abs(a[0] - b[0]) > 1e-3 for a, b in zip(got, plain))  # the steering acted on every request


def test_shared_prefix_length_equals_a_plain_scan():
    import random

    from worker.score import _shared_len

    def scan(a, b, limit):
        n = 0
        for x, y in zip(a[:limit], b[:limit]):
            if x != y:
                break
            n += 1
        return n

    rng = random.Random(0)
    for _ in range(5000):
        a = tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 30)))
        b = a[: rng.randint(0, len(a))] + tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 30)))
        limit = rng.randint(0, 40)
        assert _shared_len(a, b, limit) == scan(a, b, limit), (a, b, limit)
