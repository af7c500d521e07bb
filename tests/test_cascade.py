"""A shared prefix's KV held once and read by every row (worker.cascade): the attention it computes is the one over
each row's whole cache, for every testbed architecture, and a model whose attention does not go through the
wrapped function keeps the copied prefix."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.base as base
import pytest
from mlx_lm.models.cache import KVCache

from testbed.models import ARCHITECTURES, write_model
from worker import cascade
from worker.cascade import SharedPrefixCache
from worker.generate import GenRequest, _prefill_copied, generate_tokens
from worker.load import load
from worker.prefix_cache import store

B_KV, HEADS, D = 2, 4, 8  # kv heads, query heads (grouped 2 per kv head), head dim


def _prefix(length: int, seed: int) -> KVCache:
    kv = KVCache()
    k, v = (mx.random.normal((1, B_KV, length, D), key=mx.random.key(seed + i)) for i in (0, 1))
    kv.update_and_fetch(k, v)
    return kv


def _reference(q, groups, own_k, own_v, mask, scale):
    """Every row's prefix copied in front of its own keys, through mlx's own attention."""
    rows, start = [], 0
    for kv, n in groups:
        for b in range(start, start + n):
            pk = kv.keys[..., : kv.offset, :] if kv else mx.zeros((1, B_KV, 0, D))
            pv = kv.values[..., : kv.offset, :] if kv else mx.zeros((1, B_KV, 0, D))
            k = mx.concatenate([pk, own_k[b : b + 1]], axis=2)
            v = mx.concatenate([pv, own_v[b : b + 1]], axis=2)
            m = mx.concatenate([mx.ones((1, 1, q.shape[2], pk.shape[2]), dtype=mx.bool_), mask[b : b + 1]], axis=-1)
            rows.append(mx.fast.scaled_dot_product_attention(q[b : b + 1], k, v, scale=scale, mask=m))
        start += n
    return mx.concatenate(rows)


@pytest.mark.parametrize("queries", [1, 5])
def test_split_attention_equals_attention_over_the_copied_prefix(queries):
    """Two families with prefixes of different lengths and two rows sharing none, left-padded own tokens: each
    real query's output equals mlx's attention over [its prefix ; its own keys]; the parts held once."""
    groups = [(_prefix(7, 0), 2), (_prefix(3, 10), 3), (None, 2)]
    pads = [0, 2, 1, 0, 3, 0, 1]
    cache = SharedPrefixCache(groups, pads)
    assert cache.offset.tolist() == [7 - 0, 7 - 2, 3 - 1, 3 - 0, 3 - 3, 0, -1]  # RoPE positions count the prefix
    own = 6
    mask = cache.make_mask(own)
    k, v = (mx.random.normal((7, B_KV, own, D), key=mx.random.key(20 + i)) for i in (0, 1))
    keys, values = cache.update_and_fetch(k, v)
    q = mx.random.normal((7, HEADS, own, D), key=mx.random.key(30))[:, :, own - queries :]
    mask = mask[:, :, own - queries :]
    got = cache.attend(q, keys, values, 0.35, mask)
    want = _reference(q, groups, keys, values, mask, 0.35)
    real = mx.array(pads)[:, None, None, None] <= mx.arange(own - queries, own)[None, None, :, None]
    assert mx.all(mx.isfinite(got)).item()  # pads too: their values never poison a real row
    assert mx.allclose(mx.where(real, got, 0), mx.where(real, want, 0), atol=2e-6).item()
    assert keys.shape[2] == own  # the rows' caches hold their own tokens only


def test_filter_and_extend_keep_each_row_with_its_prefix():
    a, b = _prefix(5, 0), _prefix(4, 1)
    left = SharedPrefixCache([(a, 2), (b, 2)], [0, 0, 0, 0])
    left.update_and_fetch(*(mx.random.normal((4, B_KV, 3, D), key=mx.random.key(i)) for i in (2, 3)))
    right = SharedPrefixCache([(b, 1)], [0])
    right.update_and_fetch(*(mx.random.normal((1, B_KV, 2, D), key=mx.random.key(i)) for i in (4, 5)))
    left.extend(right)
    assert [(kv, n) for kv, n in left.groups] == [(a, 2), (b, 3)]  # one family's parts read its prefix once
    left.filter(mx.array([1, 4]))
    assert [(kv, n) for kv, n in left.groups] == [(a, 1), (b, 1)]
    assert left.offset.tolist() == [5 + 3, 4 + 2]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_lm(request, tmp_path_factory):
    return load(str(write_model(tmp_path_factory.mktemp("cascade") / request.param, arch=request.param, layers=2)))


def _families(lm):
    tok = lm.tokenizer
    shots = "the river and the king lived in the house by the city. " * 3
    ctxs = [tok.encode(shots + q) for q in ("the dog", "a cat was happy", "the queen said that")]
    ctxs += [tok.encode("once upon a time " * 6 + q) for q in ("there", "a girl and a boy ran")]
    ctxs.append(tok.encode("water"))
    return [GenRequest(tuple(c), max_gen_toks=3 + i % 3, until=()) for i, c in enumerate(ctxs)]


def test_every_architecture_passes_the_self_check_and_generates_the_same_tokens(arch_lm):
    assert cascade.usable(arch_lm, _prefill_copied)
    reqs = _families(arch_lm)
    store(arch_lm).clear()
    assert generate_tokens(arch_lm, reqs, batch_size=8) == generate_tokens(arch_lm, reqs, batch_size=1, prefix_reuse=False)


def test_a_model_whose_attention_skips_the_wrapped_function_keeps_the_copies(llama_path, monkeypatch):
    """As a family that calls mx.fast's attention itself: the self-check sees other logits and says no."""
    import mlx_lm.models.llama as family

    lm = load(str(llama_path))
    monkeypatch.setattr(family, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    monkeypatch.setattr(cascade, "install", lambda model: True)  # claims a wrapper that is not there
    assert not cascade.usable(lm, _prefill_copied)
    reqs = _families(lm)
    store(lm).clear()
    assert generate_tokens(lm, reqs, batch_size=8) == generate_tokens(lm, reqs, batch_size=1, prefix_reuse=False)


def test_a_model_with_attention_sinks_fails_the_self_check_and_keeps_the_copies(llama_path, monkeypatch):
    """As gpt-oss: attention that passes sinks through the wrapped function. The split cannot add a sink, so the
    wrapper raises inside the self-check's probe, the check says no, and generation takes the copied path."""
    import mlx_lm.models.llama as family

    wrapped = cascade._wrap(base.scaled_dot_product_attention)

    def with_sinks(queries, keys, values, cache, scale, mask):
        return wrapped(queries, keys, values, cache, scale, mask, sinks=mx.zeros((queries.shape[1],)))

    with_sinks.orchard_cascade = True  # the wrapper is in place: install finds it
    monkeypatch.setattr(family, "scaled_dot_product_attention", with_sinks)
    lm = load(str(llama_path))
    assert not cascade.usable(lm, _prefill_copied)
    reqs = _families(lm)
    store(lm).clear()
    assert generate_tokens(lm, reqs, batch_size=8) == generate_tokens(lm, reqs, batch_size=1, prefix_reuse=False)


def test_runs_share_a_prefix_of_at_least_the_minimum_and_leave_each_row_a_token():
    from worker.cascade import _runs
    from worker.score import MIN_SHARED_PREFIX as M

    a = tuple(range(100))
    rows = [a + (1, 2), a[:60] + (7, 8, 9), a + (3,), tuple(range(500, 540)), a[: M + 1]]
    # rows 0-2 share 60 tokens; rows 3 and 4 share nothing with the row before them
    assert _runs(rows) == [(60, 3), (0, 1), (0, 1)]
    assert _runs([a + (1,), a + (2,)]) == [(99, 2)]  # a common prefix stops one token before the shorter's last


def test_stored_rows_read_the_family_prefix_once_and_give_the_merged_logits(llama_path):
    """A sweep's rows, each with its own stored prompt KV: SharedPrefixCaches over the first row's prefix give the
    logits of mlx-lm's merge of the rows' whole caches (which copies every row's prefix)."""
    from worker.generate import _prefill_last
    from worker.prefix_cache import merged, prefix_kv

    lm = load(str(llama_path))
    reqs = _families(lm)[:3]
    store(lm).clear()
    prefix_kv(lm, reqs[0].context[:30])  # the family's prefix, stored first (as generate_tokens does)
    own = [prefix_kv(lm, r.context[:-1]) for r in reqs]
    held = cascade.stored_rows([r.context for r in reqs], own)
    shared = held[0].groups[0]
    assert len(held[0].groups) == 1 and shared[1] == 3 and shared[0].offset >= 30
    assert held[0].keys.shape[2] < min(len(r.context) for r in reqs) - 1 - 20  # only the rows' own tokens are copied
    got = _prefill_last(lm, reqs, held)
    want = _prefill_last(lm, reqs, merged(own))
    assert got[1:3] == want[1:3] and mx.allclose(got[3], want[3], atol=1e-5).item()


def test_copies_of_prompts_read_each_prompt_once_and_give_the_merged_logits(llama_path):
    """Configurations side by side: every prompt in 2-3 consecutive copies. The family's prefix is one group, each
    prompt's tokens after it an inner group read by its copies, each row holds one token; the logits equal the
    merge of the rows' whole caches, before and after a filter that drops one copy and a whole prompt."""
    from worker.generate import _last_logits, _prefill_last
    from worker.prefix_cache import merged, prefix_kv

    lm = load(str(llama_path))
    reqs = _families(lm)[:3]
    store(lm).clear()
    prefix_kv(lm, reqs[0].context[:30])
    rows = [reqs[0]] * 2 + [reqs[1]] * 3 + [reqs[2]] * 2
    own = [prefix_kv(lm, r.context[:-1]) for r in rows]
    held = cascade.stored_rows([r.context for r in rows], own)
    assert [n for _, n in held[0].levels[0]] == [7] and [n for _, n in held[0].levels[1]] == [2, 3, 2]
    assert held[0].keys.shape[2] == 1  # the token before each row's last; the rest is read from the groups
    copied = merged(own)
    got, want = _prefill_last(lm, rows, held), _prefill_last(lm, rows, copied)
    assert got[1:3] == want[1:3] and mx.allclose(got[3], want[3], atol=1e-5).item()
    keep = mx.array([0, 2, 3])  # the first prompt's first copy, two of the second's; the third prompt goes
    for cache in (held, copied):
        for c in cache:
            c.filter(keep)
    assert [n for _, n in held[0].levels[1]] == [1, 2]
    step = mx.array([[5], [6], [7]])
    assert mx.allclose(_last_logits(lm, step, held), _last_logits(lm, step, copied), atol=1e-5).item()
