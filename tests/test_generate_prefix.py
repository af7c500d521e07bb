"""Prefix families in generation: a shared prompt prefix is prefilled once, and nothing else changes.

Sharing on (the default) and off (`prefix_reuse=False`) must give the same tokens, greedy and seeded-sampled,
for every batch size, with stop strings, truncation and steering at every position rule; the forwards must show
that the prefix really ran once. Real random MLX models (llama, gpt2) and the shipped TinyStories-260K.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

from worker import cascade
from worker.generate import GenRequest, _prefill_copied, families, generate, generate_tokens
from worker.load import load
from worker.prefix_cache import DEFAULT_BUDGET, set_budget, store
from worker.score import MIN_SHARED_PREFIX, _prefix_cache
from worker.steer import OPS

EXEMPLARS = (
    "Question: what is the river? Answer: the water of the city. "
    "Question: who was the king? Answer: the boy who played with the dog. "
    "Question: what is red blue green? Answer: a story about the tree and the house. "
    "Question: where is the market? Answer: in the city by the river, after the war. "
    "Question: why was the girl happy? Answer: because her friend the cat came home at night. "
)
QUESTIONS = [
    "Question: what is the",
    "Question: who lived in the little house by the big mountain and",
    "Question:",
    "Question: the queen said",
    "Question: once upon a time there was a cat who saw a dog",
    "Question: water is",
]


@pytest.fixture(scope="module")
def llama(llama_path):
    return load(str(llama_path))


@pytest.fixture(scope="module", params=["llama", "gpt2", "stories"])
def lm(request):
    path = request.getfixturevalue({"llama": "llama_path", "gpt2": "gpt2_path", "stories": "stories_path"}[request.param])
    return load(str(path))


class _NoEos:
    """The model's tokenizer with no EOS id, so every row runs to its own max_gen_toks."""

    eos_token_ids: frozenset = frozenset()

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)


def no_eos(lm):
    return dataclasses.replace(lm, tokenizer=_NoEos(lm.tokenizer))


def few_shot(lm, n=len(QUESTIONS)):
    """Prompts that share a long exemplar prefix and end in questions of different lengths."""
    tok = lm.tokenizer
    shared = tok.encode(EXEMPLARS)
    out = [tuple(shared + tok.encode(" " + q, add_special_tokens=False)) for q in QUESTIONS[:n]]
    assert len(shared) >= 2 * MIN_SHARED_PREFIX
    return out


def requests(lm):
    """Greedy and seeded-sampled rows, different lengths and max_gen_toks, stop strings, one exact duplicate
    prompt and one prompt that is another's prefix (its suffix is a single token)."""
    ctxs = few_shot(lm)
    ctxs.append(ctxs[0][:-3])  # a prefix of row 0
    reqs = [GenRequest(c, max_gen_toks=5 + 3 * (i % 4)) for i, c in enumerate(ctxs)]
    reqs += [GenRequest(c, max_gen_toks=9, do_sample=True, temperature=1.3, top_p=0.95, seed=i) for i, c in enumerate(ctxs)]
    reqs.append(GenRequest(ctxs[1], max_gen_toks=9, do_sample=True, temperature=1.3, seed=99))  # same prompt, own seed
    reqs.append(GenRequest(ctxs[2], until=("e",), max_gen_toks=12))
    return reqs


class Feed:
    """Hook recording the [batch, length] of every forward at one layer (what the kernel fed the model)."""

    def __init__(self):
        self.shapes = []

    def __call__(self, x, ctx):
        self.shapes.append(tuple(x.shape[:2]))
        return x


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_sharing_on_and_off_give_the_same_tokens(lm, batch_size):
    m = no_eos(lm)
    reqs = requests(m)
    off = generate_tokens(m, reqs, batch_size=batch_size, prefix_reuse=False)
    assert off == generate_tokens(m, reqs, batch_size=1, prefix_reuse=False)  # the reference: batch-independent
    feed = Feed()
    store(m).clear()  # the prefix must be computed in this call
    with m.hooks.installed([("resid_pre.0", feed)]):
        on = generate_tokens(m, reqs, batch_size=batch_size)
    assert on == off
    assert all(len(t) == r.max_gen_toks for t, r in zip(off, reqs) if not r.until)
    # The sharing happened: one batch-1 forward over the common prefix, then no prefill longer than a suffix.
    prefix = len(m.tokenizer.encode(EXEMPLARS))
    prefills = [s for s in feed.shapes if s[1] > 1]
    assert prefills[0][0] == 1 and prefills[0][1] >= prefix
    assert all(length < 24 for _, length in prefills[1:]) and len(prefills) > 1
    sampled = [t for t, r in zip(on, reqs) if not r.greedy]
    assert len({tuple(t) for t in sampled}) > 1


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_families_and_loose_rows_decode_together(lm, batch_size):
    # Two families and rows sharing nothing, each prefilled on its own, then joined into one decode batch
    # (mlx-lm's BatchKVCache.extend): the same tokens, and with room for all, one decode forward per step.
    m = no_eos(lm)
    tok = m.tokenizer
    other = tok.encode(EXEMPLARS.replace("Answer", "Reply").replace("Question", "Ask"))
    ctxs = few_shot(m, 4) + [tuple(other + tok.encode(" " + q, add_special_tokens=False)) for q in QUESTIONS[2:5]]
    ctxs += [tuple(tok.encode(q)) for q in ("The river and the king", "a")]
    reqs = [GenRequest(c, max_gen_toks=4 + i % 5, do_sample=i % 2 == 1, temperature=1.1, seed=i) for i, c in enumerate(ctxs)]
    off = generate_tokens(m, reqs, batch_size=1, prefix_reuse=False)
    feed, real = Feed(), []

    def where(x, ctx):  # each decode row's real-token index, as hooks see it (Rows after the join)
        if x.shape[1] == 1 and ctx.rows.mask("continuation", x.shape[0], 1).all().item():  # a decode step
            real.append(sorted((ctx.rows.offset - ctx.rows.starts).tolist()))
        return x

    store(m).clear()
    with m.hooks.installed([("resid_pre.0", feed), ("resid_pre.1", where)]):
        assert generate_tokens(m, reqs, batch_size=batch_size) == off
    steps = [b for b, n in feed.shapes if n == 1]
    # Decode step t feeds each live row's token t - 1, at real index len(context) + t - 1.
    want = [sorted(len(r.context) + t - 1 for r in reqs if r.max_gen_toks > t) for t in range(1, 8)]
    assert sorted(i for step in real for i in step) == sorted(i for step in want for i in step)
    if batch_size == 16:
        assert real == want
        assert len(steps) == max(r.max_gen_toks for r in reqs) - 1 and steps[0] == len(reqs)
        assert len([s for s in feed.shapes if s[1] > 1]) == 5  # 2 prefixes, 2 families' suffixes, the loose rows


def test_texts_and_stop_strings_match(llama):
    # With EOS and stop strings on, the texts agree too (a stop string cuts mid-token in the text).
    reqs = [dataclasses.replace(r, until=(". ", "\n")) for r in requests(llama)]
    assert generate(llama, reqs, batch_size=4) == generate(llama, reqs, batch_size=4, prefix_reuse=False)


def test_truncated_contexts_match(llama):
    # A window that cuts into the exemplars: contexts are left-truncated first, then grouped.
    m = dataclasses.replace(no_eos(llama), max_length=64)
    reqs = [GenRequest(c, max_gen_toks=8) for c in few_shot(m)] + [GenRequest(c[:40], max_gen_toks=24) for c in few_shot(m)]
    assert any(len(r.context) > 64 - r.max_gen_toks for r in reqs)
    assert generate_tokens(m, reqs, batch_size=16) == generate_tokens(m, reqs, batch_size=16, prefix_reuse=False)


@pytest.mark.parametrize("positions", ["all", "prompt", "continuation", "last"])
@pytest.mark.parametrize("op", ["add", "clamp"])
def test_steering_sees_the_same_positions(lm, positions, op):
    # The prefix pass runs under the job's hooks as prompt positions (none of them any row's last): `all` and
    # `prompt` steer the shared prefix exactly as in each row's own prefill.
    m = no_eos(lm)
    reqs = [r for r in requests(m) if r.greedy]
    d = m.config.get("hidden_size") or m.config.get("n_embd") or m.config["dim"]
    v = mx.random.normal((d,), key=mx.random.key(3)) * 4.0
    hook = OPS[op](v, alpha=1.0 if op == "add" else 40.0, positions=positions)
    plain = generate_tokens(m, reqs, batch_size=3)
    with m.hooks.installed([("resid_pre.1", hook)]):
        off = generate_tokens(m, reqs, batch_size=3, prefix_reuse=False)
    with m.hooks.installed([("resid_pre.1", hook)]):
        on = generate_tokens(m, reqs, batch_size=3)
    assert on == off
    assert off != plain  # the steering mattered


def test_families_for_the_scheduler(llama):
    ctxs = few_shot(llama)
    other = tuple(llama.tokenizer.encode("The river and the king"))
    reqs = [GenRequest(c, max_gen_toks=4) for c in ctxs] + [GenRequest(other), GenRequest(ctxs[0], max_gen_toks=0)]
    n = len(ctxs)
    assert sorted(families(reqs, llama.max_length)) == sorted([list(range(n)), [n], [n + 1]])
    assert sorted(families(reqs, llama.max_length, reuse=False)) == [[i] for i in range(n + 2)]
    # In a 34-token window the truncated prompts keep 30 tokens: fewer than MIN_SHARED_PREFIX to share.
    assert sorted(families(reqs, 34)) == [[i] for i in range(n + 2)]


def test_short_common_prefix_is_not_shared(llama):
    feed = Feed()
    reqs = [GenRequest(tuple(llama.tokenizer.encode(q)), max_gen_toks=3) for q in QUESTIONS]
    with llama.hooks.installed([("resid_pre.0", feed)]):
        generate_tokens(llama, reqs, batch_size=16)
    assert [s for s in feed.shapes if s[1] > 1] == [(len(reqs), max(len(r.context) for r in reqs))]


def test_sliding_window_model_falls_back(tmp_path):
    import json

    from testbed.models import write_model

    path = write_model(tmp_path / "swa", arch="llama")
    config = json.loads((path / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    (path / "config.json").write_text(json.dumps(config))
    m = no_eos(load(str(path)))
    reqs = [GenRequest(c, max_gen_toks=6) for c in few_shot(m)]
    assert generate_tokens(m, reqs, batch_size=4) == generate_tokens(m, reqs, batch_size=4, prefix_reuse=False)


# --- the per-model prefix KV store across calls (chunks) ----------------------------------------------


def chunks(lm):
    """Three chunks of one task: the same exemplars; chunk 2's rows share a longer prefix than chunk 1's."""
    tok = lm.tokenizer
    ex = tok.encode(EXEMPLARS)

    def ctx(text):
        return tuple(ex + tok.encode(text, add_special_tokens=False))

    one = [GenRequest(ctx(" " + q), max_gen_toks=6) for q in QUESTIONS[:3]]
    two = [GenRequest(ctx(" Question: where did the little girl and the dog go" + q[9:]), max_gen_toks=6) for q in QUESTIONS[3:]]
    return one, two


def prefills(m, reqs, **kw):
    """Tokens, and the [batch, length] of every multi-token body forward (seen by wrapping the body, since any
    hook that is not a steering op turns the store off)."""
    shapes = []
    cascade.usable(m, _prefill_copied)  # the model's one-time self-check runs before the counting

    def body(x, cache=None):
        shapes.append(tuple(x.shape[:2]))
        return m.head.body(x, cache=cache)

    counted = dataclasses.replace(m, head=dataclasses.replace(m.head, body=body))
    out = generate_tokens(counted, reqs, batch_size=4, **kw)
    return out, [s for s in shapes if s[1] > 1]


@pytest.mark.parametrize("positions", [None, "all", "last"])
def test_later_chunks_reuse_the_stored_prefix(llama, positions):
    # Under steering too: the extension pass runs under the job's hooks with the prefix pass's Rows.
    m = no_eos(llama)
    hooks = [] if positions is None else [("resid_pre.1", OPS["add"](_configs(m)[3] * 10, positions=positions))]
    with m.hooks.installed(hooks):
        _chunks_reuse(m)


def _chunks_reuse(m):
    one, two = chunks(m)
    s = store(m)
    s.clear()
    got, shapes = prefills(m, one)
    assert got == generate_tokens(m, one, batch_size=4, prefix_reuse=False)
    assert shapes[0][0] == 1 and shapes[0][1] >= MIN_SHARED_PREFIX  # computed: a miss
    got, shapes = prefills(m, two)  # a longer shared prefix: the stored one runs on through the extra tokens
    assert got == generate_tokens(m, two, batch_size=4, prefix_reuse=False)
    assert shapes[0][0] == 1 and shapes[0][1] < 16
    got, shapes = prefills(m, one)  # the same family again: a hit, no prefix forward at all
    assert got == generate_tokens(m, one, batch_size=4, prefix_reuse=False)
    assert all(b > 1 or n < 16 for b, n in shapes) and len(shapes) == 1
    assert (s.misses, s.extended, s.hits, len(s.entries)) == (1, 1, 1, 2) and s.nbytes <= s.budget
    # The extended entry holds the KV a fresh prefix pass computes (to float rounding: other forward splits).
    (_, tokens), (extended, _) = max(s.entries.items(), key=lambda kv: len(kv[0][1]))
    fresh = _prefix_cache(m, tokens)
    for a, b in zip(extended, fresh):
        assert a.offset == b.offset == len(tokens)
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert mx.allclose(x[..., : len(tokens), :], y[..., : len(tokens), :], atol=1e-5).item()


def test_eviction_in_the_middle_of_a_task(llama):
    m = no_eos(llama)
    one, two = chunks(m)
    other = [GenRequest(tuple(m.tokenizer.encode(EXEMPLARS.replace("Answer", "Reply") + q)), max_gen_toks=5) for q in QUESTIONS[:3]]
    s = store(m)
    s.clear()
    generate_tokens(m, other, batch_size=4)
    generate_tokens(m, one, batch_size=4)
    sizes = [n for _, n in s.entries.values()]
    assert len(sizes) == 2
    set_budget(m, max(sizes) + min(sizes) // 2)  # room for one of these entries only
    assert len(s.entries) == 1  # `other`, the least recently used, went
    try:
        for reqs in (other, one, other):  # each evicts the one before
            out, shapes = prefills(m, reqs)
            assert out == generate_tokens(m, reqs, batch_size=4, prefix_reuse=False)
            assert shapes[0][0] == 1 and shapes[0][1] >= MIN_SHARED_PREFIX  # recomputed each time
        assert s.evicted >= 3 and s.peak <= s.budget and len(s.entries) == 1
    finally:
        set_budget(m, DEFAULT_BUDGET)


def _configs(m):
    d = m.config["hidden_size"]
    v = [mx.random.normal((d,), key=mx.random.key(k)) * 4.0 for k in range(3)]
    a = [("resid_pre.0", OPS["add"](v[0])), ("resid_pre.1", OPS["add"](v[1]))]
    b = [("resid_pre.0", OPS["add"](v[0])), ("resid_pre.1", OPS["add"](v[2]))]  # differs at layer 1 only
    return a, b, [("resid_pre.1", OPS["add"](v[0], positions="continuation"))], v[1]


def test_configurations_differing_at_one_layer_never_share(llama):
    m = no_eos(llama)
    one, _ = chunks(m)
    a, b, _, _ = _configs(m)
    s = store(m)
    s.clear()
    outs = {}
    for name, hooks in (("a", a), ("b", b)):
        with m.hooks.installed(hooks):
            want = generate_tokens(m, one, batch_size=4, prefix_reuse=False)
            outs[name] = generate_tokens(m, one, batch_size=4)
            assert outs[name] == want
    assert outs["a"] != outs["b"]
    assert (s.misses, s.hits, s.extended, len(s.entries)) == (2, 0, 0, 2)
    with m.hooks.installed(_configs(m)[0]):  # the same configuration again (new op objects): a hit
        assert generate_tokens(m, one, batch_size=4) == outs["a"]
    assert s.hits == 1


def test_continuation_steering_shares_the_plain_prefix(llama):
    # An op at continuation positions never touches the prefix: the unsteered entry serves it; a capture hook
    # (not a steering op) bypasses the store.
    from worker.hooks import Capture

    m = no_eos(llama)
    one, _ = chunks(m)
    s = store(m)
    s.clear()
    generate_tokens(m, one, batch_size=4)
    with m.hooks.installed(_configs(m)[2]):
        want = generate_tokens(m, one, batch_size=4, prefix_reuse=False)
        assert generate_tokens(m, one, batch_size=4) == want
    assert (s.misses, s.hits) == (1, 1)
    with m.hooks.installed([("resid_post.0", Capture("last"))]):
        generate_tokens(m, one, batch_size=4)
    assert (s.misses, s.hits, len(s.entries)) == (1, 1, 1)


def test_a_jobs_batching_sets_the_store_budget_and_the_counters_say_what_was_reused(llama):
    from worker.jobs import run
    from worker.spec import Batching, Job

    m = no_eos(llama)
    one, _ = chunks(m)
    s = store(m)
    job, batching = Job(kind="generate"), Batching(batch_size=4, prefix_cache_mb=64)
    try:
        s.clear()
        first = run(m, job, one, batching)
        assert s.budget == 64 << 20 and (s.misses, s.hits, s.reused) == (1, 0, 0)
        assert run(m, job, one, batching) == first  # the next chunk of the task: the exemplars from the store
        ((_, tokens),) = s.entries
        stats = s.stats()
        assert (stats["hits"], stats["tokens_reused"]) == (1, len(tokens)) and 0 < stats["peak_bytes"] <= stats["budget"]
        assert run(m, job, one, Batching(batch_size=4, prefix_cache_mb=0)) == first  # off: nothing kept or looked up
        assert s.budget == 0 and not s.entries and (s.hits, s.evicted) == (1, 1)
    finally:
        set_budget(m, DEFAULT_BUDGET)


def test_a_familys_suffixes_are_cut_by_length_and_decode_together(llama):
    # Suffixes of 1 to 40 tokens after one shared prefix: prefilled longest first in parts closed (from MIN_ROWS = 4
    # rows on) before their pads pass worker.score's MAX_PADDING (15%) of their tokens, then decoded as one batch.
    m = no_eos(llama)
    shared = tuple(m.tokenizer.encode(EXEMPLARS))
    lengths = (1, 2, 3, 5, 8, 12, 18, 25, 33, 40)
    reqs = [GenRequest(shared + tuple(range(300, 300 + n)), max_gen_toks=3) for n in lengths]
    shapes = []
    cascade.usable(m, _prefill_copied)  # the model's one-time self-check runs before the counting

    def body(x, cache=None):
        shapes.append(tuple(x.shape[:2]))
        return m.head.body(x, cache=cache)

    store(m).clear()
    got = generate_tokens(dataclasses.replace(m, head=dataclasses.replace(m.head, body=body)), reqs, batch_size=16)
    assert got == generate_tokens(m, reqs, batch_size=16, prefix_reuse=False)
    # 40 33 25 18 | 12 8 5 3 | 2 1 (adding 12 to the first part: 5 x 40 padded > 1.15 x 128 real tokens)
    assert shapes == [(1, len(shared)), (4, 40), (4, 12), (2, 2), (10, 1), (10, 1)]
