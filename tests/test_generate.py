"""generate_until kernel: batching, stop rules, truncation, seeded sampling and hooks on real tiny MLX models."""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import pytest

from worker.generate import GenRequest, generate, generate_tokens
from worker.sampling import stop_at, warp_logits
from worker.hooks import Capture
from worker.steer import Add
from worker.load import load
from testbed.models import write_model

PROMPTS = [
    "The river and the king",
    "Question: what is the",
    "a",
    "Once upon a time there lived a little girl who played with her dog in the house",
    "red blue green",
    "Water is",
]


# Model folders come from conftest's session fixtures (testbed.models.write_model), loaded once here.
@pytest.fixture(scope="module")
def llama(llama_path):
    return load(str(llama_path))


@pytest.fixture(scope="module")
def gpt2(gpt2_path):
    return load(str(gpt2_path))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def lm(request):
    return request.getfixturevalue(request.param)


def ids(lm, text):
    return tuple(lm.tokenizer.encode(text))


class _Tok:
    """The model's tokenizer with other EOS ids, to drive the EOS rule without editing weights."""

    def __init__(self, tok, eos):
        self._tok, self.eos_token_ids = tok, set(eos)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def with_eos(lm, eos):
    return dataclasses.replace(lm, tokenizer=_Tok(lm.tokenizer, eos))


# --- batching --------------------------------------------------------------------------------------


def test_batched_greedy_equals_unbatched(lm):
    # Different lengths (padding) and different max_gen_toks (rows leave the batch at different steps).
    reqs = [GenRequest(ids(lm, p), max_gen_toks=6 + 3 * i) for i, p in enumerate(PROMPTS)]
    one = generate_tokens(lm, reqs, batch_size=1)
    assert all(0 < len(t) <= r.max_gen_toks for t, r in zip(one, reqs))
    assert generate_tokens(lm, reqs, batch_size=4) == one
    assert generate_tokens(lm, reqs, batch_size=16) == one
    assert generate(lm, reqs, batch_size=4) == [lm.tokenizer.decode(t, skip_special_tokens=True) for t in one]


def test_sliding_window_model_batches(tmp_path):
    # Sliding-window layers get BatchRotatingKVCache; prompts longer than the window exercise rotation.
    path = write_model(tmp_path / "swa", arch="llama")
    config = json.loads((path / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    (path / "config.json").write_text(json.dumps(config))
    m = with_eos(load(str(path)), [])
    reqs = [GenRequest(ids(m, p), max_gen_toks=4 + 2 * i) for i, p in enumerate(PROMPTS)]
    assert max(len(r.context) for r in reqs) > 2 * 8 and max(r.max_gen_toks for r in reqs) > 8
    # The oracle is mlx-lm's own loop: its plain model, its RotatingKVCache, its greedy sampler, one request at a time.
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
    from mlx_lm.utils import load as mlx_load

    plain, _ = mlx_load(str(path))
    assert [type(c) for c in make_prompt_cache(plain)][0] is RotatingKVCache
    expected = []
    for r in reqs:
        steps = generate_step(mx.array(r.context), plain, max_tokens=r.max_gen_toks, prompt_cache=make_prompt_cache(plain))
        expected.append([int(t) for t, _ in steps])
    assert generate_tokens(m, reqs, batch_size=1) == expected
    assert generate_tokens(m, reqs, batch_size=16) == expected
    assert generate_tokens(m, reqs, batch_size=4) == expected


def test_matches_transformers_greedy(lm):
    pytest.importorskip("torch")
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(lm.path), dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    reqs = [GenRequest(ids(lm, p), max_gen_toks=12) for p in PROMPTS[:4]]
    ours = generate_tokens(lm, reqs, batch_size=4)
    for r, got in zip(reqs, ours):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([r.context]), attention_mask=torch.ones(1, len(r.context), dtype=torch.long),
                do_sample=False, max_new_tokens=r.max_gen_toks, pad_token_id=eos,
            )
        new = out[0, len(r.context) :].tolist()
        if eos in new:  # HF keeps the EOS it stopped at; the kernel does not
            new = new[: new.index(eos)]
        assert got == new


# --- stop rules ------------------------------------------------------------------------------------


def _greedy(lm, prompt, n=16):
    # EOS switched off so the reference continuation always has n tokens.
    plain = with_eos(lm, [])
    return plain, generate_tokens(plain, [GenRequest(ids(lm, prompt), max_gen_toks=n)])[0]


def _first_stop(lm, toks, stop):
    # The reference rule: the first prefix whose full decoded text (special tokens kept) holds the stop string.
    return next(k for k in range(1, len(toks) + 1) if stop in lm.tokenizer.decode(toks[:k], skip_special_tokens=False))


@pytest.mark.parametrize("at", [4, 30, 44])  # 30 and 44 lie past the kernel's re-decode window for 2 chars
def test_stop_string_spanning_tokens(llama, at):
    lm, toks = _greedy(llama, PROMPTS[0], n=48)
    dec = lambda t: lm.tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731

    def clean(j):  # token j adds whole characters after whole characters
        a, b = dec(toks[:j]), dec(toks[: j + 1])
        return 0 < len(a) < len(b) and b.startswith(a) and "\ufffd" not in b[len(a) - 1 : len(a) + 1]

    j = next(j for j in range(at, len(toks)) if clean(j))
    a, b = dec(toks[:j]), dec(toks[: j + 1])
    stop = a[-1] + b[len(a)]  # last char before token j + its first char: completed by token j at the earliest
    k = _first_stop(lm, toks, stop)
    assert k <= j + 1
    req = GenRequest(ids(lm, PROMPTS[0]), until=(stop,), max_gen_toks=48)
    assert generate_tokens(lm, [req])[0] == toks[:k]
    assert generate(lm, [req])[0] == dec(toks).split(stop)[0]


def test_stop_string_inside_one_token(llama):
    lm, toks = _greedy(llama, PROMPTS[3])
    dec = lambda t: lm.tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    # A multi-char token: stop on its middle characters.
    j = next(j for j in range(1, len(toks)) if len(dec(toks[: j + 1])) - len(dec(toks[:j])) >= 3)
    piece = dec(toks[: j + 1])[len(dec(toks[:j])) :]
    stop = piece[1:-1] if len(piece) >= 3 else piece[1:]
    k = _first_stop(lm, toks, stop)
    req = GenRequest(ids(lm, PROMPTS[3]), until=("never-there", stop), max_gen_toks=16)
    assert generate_tokens(lm, [req])[0] == toks[:k]
    assert generate(lm, [req])[0] == stop_at(dec(toks), req.until)
    assert len(generate(lm, [req])[0]) < len(dec(toks[:k]))


def test_special_token_stop_string(llama):
    # lm-eval's stopping criteria decode with special tokens, so a non-EOS special token named in `until`
    # (e.g. "<|im_end|>") ends the row; the returned text is decoded without it. A logit bonus makes the
    # model emit "<s>" from its third token on.
    bos = llama.tokenizer.convert_tokens_to_ids("<s>")
    calls = []

    def head(h):
        calls.append(1)
        logits = llama.head.head(h)
        bonus = mx.zeros((logits.shape[-1],)).at[bos].add(1e4)
        return logits + bonus if len(calls) > 2 else logits

    m = dataclasses.replace(with_eos(llama, []), head=dataclasses.replace(llama.head, head=head))
    req = GenRequest(ids(m, PROMPTS[1]), until=("<s>",), max_gen_toks=6)
    got = generate_tokens(m, [req])[0]
    assert len(got) == 3 and got[2] == bos
    calls.clear()
    assert generate(m, [req])[0] == m.tokenizer.decode(got[:2], skip_special_tokens=True)
    calls.clear()
    assert generate_tokens(m, [dataclasses.replace(req, until=())])[0][2:] == [bos] * 4


def _one_stops(lm, n=12):
    """Greedy outputs (EOS off) of every prompt, and a token k of PROMPTS[3]'s output (the longest prompt: the
    first row of its batch) that appears nowhere before it nor in any other prompt's n tokens: as EOS, it
    ends that row only."""
    plain = with_eos(lm, [])
    reqs = [GenRequest(ids(lm, p), max_gen_toks=n) for p in PROMPTS]
    outs = generate_tokens(plain, reqs, batch_size=1)
    me = outs[3]
    others = {t for j, o in enumerate(outs) if j != 3 for t in o}
    # Mid-run if it can (llama); the tiny gpt2 repeats one token per prompt, so there it is the first token.
    k = next(k for k in [*range(2, n - 2), 0, 1] if me[k] not in me[:k] and me[k] not in others)
    return reqs, outs, k


def test_one_rows_eos_ends_that_row_only(lm):
    reqs, outs, k = _one_stops(lm)
    m = with_eos(lm, [outs[3][k]])
    expected = [o if j != 3 else o[:k] for j, o in enumerate(outs)]
    assert [generate_tokens(m, [r])[0] for r in reqs] == expected  # each row alone
    for batch_size in (16, 3, 2):
        assert generate_tokens(m, reqs, batch_size=batch_size) == expected, batch_size


def test_one_rows_stop_string_ends_that_row_only(lm):
    reqs, outs, _ = _one_stops(lm)
    dec = lambda t: lm.tokenizer.decode(t, skip_special_tokens=False)  # noqa: E731
    me = outs[3]
    texts = [dec(o) for j, o in enumerate(outs) if j != 3]

    def usable(k):  # the characters token k adds: not seen before in this row, nor anywhere in the others
        piece = dec(me[: k + 1])[len(dec(me[:k])) :]
        return piece.strip() and "\ufffd" not in piece and piece not in dec(me[:k]) and not any(piece in t for t in texts)

    k = next(k for k in [*range(2, len(me) - 2), 0, 1] if usable(k))
    stop = dec(me[: k + 1])[len(dec(me[:k])) :]
    stops = [dataclasses.replace(r, until=(stop,) if j == 3 else ("never-there", stop)) for j, r in enumerate(reqs)]
    m = with_eos(lm, [])
    expected = [o if j != 3 else o[: _first_stop(lm, me, stop)] for j, o in enumerate(outs)]
    assert len(expected[3]) <= k + 1 < len(outs[3])
    assert [generate_tokens(m, [r])[0] for r in stops] == expected  # each row alone
    for batch_size in (16, 3, 2):
        assert generate_tokens(m, stops, batch_size=batch_size) == expected, batch_size
    texts = generate(m, stops, batch_size=16)
    assert texts[3] == lm.tokenizer.decode(me, skip_special_tokens=True).split(stop)[0]


def test_eos_stops_and_is_dropped(lm):
    plain, toks = _greedy(lm, PROMPTS[1], n=10)
    eos_tok = toks[3]
    first = toks.index(eos_tok)
    m = with_eos(lm, [eos_tok])
    reqs = [GenRequest(ids(lm, PROMPTS[1]), max_gen_toks=10), GenRequest(ids(lm, PROMPTS[3]), max_gen_toks=10)]
    got = generate_tokens(m, reqs, batch_size=2)
    assert got[0] == toks[:first]
    assert eos_tok not in got[1]
    assert generate(m, reqs[:1])[0] == plain.tokenizer.decode(toks[:first], skip_special_tokens=True)


def test_max_gen_toks_zero_and_too_large(llama):
    assert generate(llama, [GenRequest(ids(llama, "a b"), max_gen_toks=0)]) == [""]
    with pytest.raises(ValueError, match=r"\(512\).*\(512\)"):
        generate(llama, [GenRequest(ids(llama, "a b"), max_gen_toks=512)])
    with pytest.raises(ValueError, match="empty context"):
        generate(llama, [GenRequest((), max_gen_toks=3)])
    assert generate(llama, []) == []


def test_long_context_is_left_truncated(lm):
    small = dataclasses.replace(lm, max_length=24)
    long = ids(lm, " ".join(PROMPTS))
    assert len(long) > 24
    req = GenRequest(long, max_gen_toks=6)
    cut = GenRequest(long[-18:], max_gen_toks=6)
    assert generate_tokens(small, [req]) == generate_tokens(lm, [cut])
    assert generate_tokens(small, [req]) != generate_tokens(lm, [req])


# --- sampling --------------------------------------------------------------------------------------


def test_seeded_sampling_independent_of_batch(lm):
    target = GenRequest(ids(lm, PROMPTS[0]), max_gen_toks=12, do_sample=True, temperature=1.5, top_p=0.95, seed=7)
    # Neighbours of other lengths (so different padding), some greedy, leaving the batch at different steps.
    others = [
        GenRequest(ids(lm, p), max_gen_toks=4 + i, do_sample=i % 2 == 0, temperature=1.0, seed=i)
        for i, p in enumerate(PROMPTS[1:])
    ]
    m = with_eos(lm, [])
    alone = generate_tokens(m, [target])[0]
    assert generate_tokens(m, [*others[:2], target, *others[2:]], batch_size=16)[2] == alone
    assert generate_tokens(m, [*others, target], batch_size=3)[-1] == alone
    assert len(alone) == 12
    seeds = {tuple(generate_tokens(m, [dataclasses.replace(target, seed=s)])[0]) for s in range(4)}
    assert len(seeds) > 1
    greedy = generate_tokens(m, [dataclasses.replace(target, do_sample=False)])[0]
    assert generate_tokens(m, [dataclasses.replace(target, temperature=0.0)])[0] == greedy


def test_each_sampled_token_draws_with_its_own_steps_key(llama):
    """Step t of a sampled row draws argmax(warped logits + Gumbel noise from key t of the row's own seed):
    the same seed gives the same text in any batch and in any later version of the kernel."""
    from worker.sampling import sample_keys

    m = with_eos(llama, [])
    r = GenRequest(ids(m, PROMPTS[0]), max_gen_toks=6, do_sample=True, temperature=2.0, top_k=0, seed=11)
    got = generate_tokens(m, [r])[0]
    keys, context = sample_keys(r), list(r.context)
    for step, token in enumerate(got):
        logits = m.model(mx.array([context]))[:, -1, :].astype(mx.float32)
        noise = mx.random.gumbel((logits.shape[-1],), key=keys[step])
        assert token == int(mx.argmax(warp_logits(logits, [r])[0] + noise).item()), step
        context.append(token)


def test_warpers_match_transformers():
    pytest.importorskip("torch")
    import numpy as np
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = np.random.default_rng(0).standard_normal((5, 300)).astype(np.float32) * 3
    settings = [(0.7, 50, 0.9), (1.0, 0, 0.5), (1.3, 10, 1.0), (0.5, 0, 1.0), (2.0, 300, 0.99)]
    reqs = [GenRequest((1,), do_sample=True, temperature=t, top_k=k, top_p=p) for t, k, p in settings]
    ours = np.array(warp_logits(mx.array(logits), reqs))
    for row, (t, k, p) in enumerate(settings):
        x = torch.tensor(logits[row : row + 1])
        # transformers' own order and skip rules (generation/utils.py _get_logits_processor)
        if t != 1.0:
            x = TemperatureLogitsWarper(t)(None, x)
        if k:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1.0:
            x = TopPLogitsWarper(p)(None, x)
        ref = x.numpy()[0]
        assert (np.isinf(ours[row]) == np.isinf(ref)).all()
        kept = ~np.isinf(ref)
        assert 0 < kept.sum() < 300 or (k in (0, 300) and p == 1.0)
        np.testing.assert_allclose(ours[row][kept], ref[kept], rtol=1e-6)


def test_invalid_settings_raise(llama):
    for bad in (dict(temperature=-1.0), dict(top_p=1.5), dict(top_k=-1), dict(max_gen_toks=-1)):
        with pytest.raises(ValueError, match="invalid generation settings"):
            generate(llama, [GenRequest((1, 2), **bad)])


def test_top_p_and_top_k_restrict_to_the_best_token(llama):
    # A tiny nucleus (or k=1) keeps only the argmax: sampling then equals greedy whatever the seed.
    m = with_eos(llama, [])
    base = GenRequest(ids(m, PROMPTS[2]), max_gen_toks=8, do_sample=True, temperature=1.0)
    greedy = generate_tokens(m, [dataclasses.replace(base, do_sample=False)])[0]
    for s in range(3):
        assert generate_tokens(m, [dataclasses.replace(base, top_p=1e-6, seed=s)])[0] == greedy
        assert generate_tokens(m, [dataclasses.replace(base, top_k=1, seed=s)])[0] == greedy


# --- hooks -----------------------------------------------------------------------------------------


class Record:
    """Custom hook: per forward, the input, the Rows and the masks the interventions would use."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, ctx):
        B, S, _ = x.shape
        r = ctx.rows
        self.calls.append(
            dict(
                x=x, offset=r.offset, S=S,
                all=r.mask("all", B, S).tolist(),
                prompt=r.mask("prompt", B, S).tolist(),
                generated=r.mask("continuation", B, S).tolist(),
                last=r.mask("last", B, S).tolist(),
                # each token's index among its own row's real tokens
                real_index=(mx.arange(r.offset, r.offset + S)[None, :] - r.starts[:, None]).tolist(),
            )
        )
        return x


def _vector(lm, scale=3.0):
    d = lm.config.get("hidden_size") or lm.config["n_embd"]
    return mx.random.normal((d,), key=mx.random.key(1)) * scale


def test_generated_add_leaves_prompt_forward(lm):
    m = with_eos(lm, [])
    reqs = [GenRequest(ids(m, p), max_gen_toks=8) for p in PROMPTS[:3]]
    base = generate_tokens(m, reqs, batch_size=4)
    cap = Capture("all")
    with m.hooks.installed([("resid_post.1", cap)]):
        generate_tokens(m, reqs, batch_size=4)
    plain_prefill = cap.records[0]
    cap = Capture("all")
    with m.hooks.installed([("resid_pre.1", Add(_vector(m), positions="continuation")), ("resid_post.1", cap)]):
        steered = generate_tokens(m, reqs, batch_size=4)
    for a, b in zip(plain_prefill, cap.records[0]):
        assert mx.array_equal(a, b).item()
    assert steered != base


def test_prompt_add_only_in_prefill(lm):
    m = with_eos(lm, [])
    reqs = [GenRequest(ids(m, p), max_gen_toks=6) for p in PROMPTS[:4]]
    base = generate_tokens(m, reqs, batch_size=4)
    before, after = Record(), Record()
    hooks = [("resid_pre.0", before), ("resid_pre.0", Add(_vector(m), positions="prompt")), ("resid_pre.0", after)]
    with m.hooks.installed(hooks):
        steered = generate_tokens(m, reqs, batch_size=4)
    assert steered != base
    assert len(before.calls) == 6  # one prefill + 5 decode steps
    pre, post = before.calls[0], after.calls[0]
    assert pre["offset"] == 0 and pre["S"] > 1 and any(map(any, pre["prompt"]))
    changed = (mx.abs(post["x"] - pre["x"]).max(axis=-1) > 0).tolist()
    assert changed == pre["prompt"]  # exactly the real prompt tokens, pads untouched
    for b, a in zip(before.calls[1:], after.calls[1:]):
        assert not any(map(any, b["prompt"])) and all(map(all, b["generated"]))
        assert mx.array_equal(b["x"], a["x"]).item()


def test_rows_track_real_positions_and_pads(llama):
    # Rows leave at different steps (max_gen_toks differ), so the cache sheds left padding mid-run: the
    # Rows given to hooks must keep every row's real position right and never select a pad.
    m = with_eos(llama, [])
    reqs = [GenRequest(ids(m, p), max_gen_toks=n) for p, n in zip(PROMPTS, (3, 9, 5, 2, 7, 4))]
    rec = Record()
    before, after = Record(), Record()
    add = Add(_vector(m), positions="all")
    hooks = [("resid_pre.1", rec), ("resid_post.0", before), ("resid_post.0", add), ("resid_post.0", after)]
    with m.hooks.installed(hooks):
        generate_tokens(m, reqs, batch_size=16)
    lengths = sorted((len(r.context), r.max_gen_toks) for r in reqs)[::-1]  # batch order: longest first
    prefill = rec.calls[0]
    P = lengths[0][0]
    for row, (n, _) in enumerate(lengths):
        assert prefill["all"][row] == [False] * (P - n) + [True] * n
        assert prefill["last"][row] == [False] * (P - 1) + [True]  # left padding: every prompt ends at P - 1
        assert prefill["real_index"][row][P - n :] == list(range(n))
    changed = (mx.abs(after.calls[0]["x"] - before.calls[0]["x"]).max(axis=-1) > 0).tolist()
    assert changed == prefill["all"]  # Add("all") touched every real token and no pad
    for step, call in enumerate(rec.calls[1:], start=1):
        # Decode forward `step` feeds generated token step-1 of each row still running.
        live = [n for n, g in lengths if g > step]
        assert call["S"] == 1 and sorted(r[0] for r in call["real_index"]) == sorted(n + step - 1 for n in live)
        assert all(r == [True] for r in call["generated"]) and all(r == [False] for r in call["prompt"])
        assert all(r == [True] for r in call["last"])  # the token fed is each row's newest, so its last
    assert len(rec.calls) == max(g for _, g in lengths)


# --- request contract, warper edges, scripted outputs ------------------------------------------------


def scripted(lm, script):
    """`lm` (EOS off) whose head adds a 1e4 logit to token script[n] at forward n (0: the prefill), every row:
    the kernel's rules then act on a known token sequence. Returns the model and its forward counter."""
    calls = []

    def head(h):
        logits = lm.head.head(h)
        n = len(calls)
        calls.append(1)
        if n < len(script):
            return logits + mx.zeros((logits.shape[-1],)).at[script[n]].add(1e4)
        return logits

    return dataclasses.replace(with_eos(lm, []), head=dataclasses.replace(lm.head, head=head)), calls


def test_request_defaults_follow_lm_eval_and_hf():
    r = GenRequest((1, 2))
    # lm-eval's HF backend: max_gen_toks 256, greedy unless do_sample; HF's sampling defaults: top_k 50, top_p 1.
    assert (r.until, r.max_gen_toks, r.do_sample, r.temperature, r.top_p, r.seed, r.top_k) == ((), 256, False, 0.0, 1.0, 0, 50)
    assert r.greedy and GenRequest((1,), temperature=0.7).greedy and GenRequest((1,), do_sample=True).greedy
    assert not GenRequest((1,), do_sample=True, temperature=0.5).greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.seed = 1  # type: ignore[misc]
    assert len({r, GenRequest((1, 2))}) == 1  # hashable by value: the driver dedupes and keys requests


def test_top_p_edges_match_hf_rules(llama):
    import numpy as np

    def warp(rows, **kw):
        reqs = [GenRequest((1,), do_sample=True, temperature=1.0, top_k=0, **k) for k in kw["settings"]]
        return np.array(warp_logits(mx.array(np.array(rows, np.float32)), reqs))

    logits = np.random.default_rng(1).standard_normal((2, 40)).astype(np.float32)
    # top_p = 0 is allowed (as in HF) and keeps exactly the best token: at least one token always survives.
    out = warp(logits, settings=[dict(top_p=0.0), dict(top_p=1e-9)])
    for row in range(2):
        assert np.flatnonzero(~np.isinf(out[row])).tolist() == [int(np.argmax(logits[row]))]
    # HF removes a token whose cumulative mass (ascending order) is <= 1 - top_p: at equality it goes too.
    flat = [[0.0, 0.0, 0.0, 0.0]] * 3
    out = warp(flat, settings=[dict(top_p=0.75), dict(top_p=0.5), dict(top_p=1.0)])
    assert np.isinf(out).sum(axis=-1).tolist() == [1, 2, 0]
    # A top_p = 1 row next to a top_p < 1 row keeps every token, even ones whose probability underflows to 0.
    wide = [[0.0, -200.0, -300.0, 5.0]] * 2
    out = warp(wide, settings=[dict(top_p=1.0), dict(top_p=0.9)])
    assert np.isfinite(out[0]).all() and np.isinf(out[1]).sum() == 3
    # ... and in generation: a top_p = 0 request is valid and samples the greedy tokens whatever its seed.
    m = with_eos(llama, [])
    base = GenRequest(ids(m, PROMPTS[4]), max_gen_toks=6, do_sample=True, temperature=1.5, top_k=0)
    greedy = generate_tokens(m, [dataclasses.replace(base, do_sample=False)])[0]
    assert all(generate_tokens(m, [dataclasses.replace(base, top_p=0.0, seed=s)])[0] == greedy for s in range(3))


def test_long_stop_string_of_byte_tokens(llama):
    # "𝄞" is four byte tokens in this tokenizer: a stop string of 17 of them ends 68 tokens after it starts, so
    # the re-decode window must reach back over all of them (a shorter stop string in `until` must not shrink it).
    tok = llama.tokenizer
    clef = tok.encode("𝄞", add_special_tokens=False)
    assert len(clef) == 4 and tok.decode(clef) == "𝄞"
    head, tail = tok.encode(" king and", add_special_tokens=False), tok.encode(" the", add_special_tokens=False)
    script = head + clef * 17 + tail * 4
    m, calls = scripted(llama, script)
    req = GenRequest(ids(m, PROMPTS[0]), until=("zzzz", "𝄞" * 17), max_gen_toks=len(script))
    assert generate_tokens(m, [req])[0] == script[: len(head) + 68]
    calls.clear()
    assert generate(m, [req])[0] == " king and"
    calls.clear()
    assert generate_tokens(m, [dataclasses.replace(req, until=("𝄞" * 18,))])[0] == script  # never completed


def test_sample_key_stream_is_pinned():
    """Step t of a sampled row draws with key t of split(key(seed mod 2**64), max(2, max_gen_toks)). Pinned, so a
    seed gives the same draws in later versions of the kernel; negative seeds wrap instead of failing."""
    from worker.sampling import sample_keys

    def keys(n, seed):
        return sample_keys(GenRequest((1,), max_gen_toks=n, do_sample=True, temperature=1.0, seed=seed)).tolist()

    assert keys(1, 5) == keys(2, 5) == [[3594430910, 534832770], [1784718894, 3813648515]]
    assert keys(3, 5) == [[2939540675, 3006210766], [3038296040, 3076691462], [279368646, 2516963019]]
    assert keys(4, -1) == [[2207594703, 2416891345], [1865467372, 639500838], [272068005, 679881962], [1738971448, 1013201929]]
    assert len({tuple(map(tuple, keys(3, s))) for s in range(4)}) == 4


def test_each_seed_draws_its_own_sample(llama):
    m = with_eos(llama, [])
    r = GenRequest(ids(m, PROMPTS[0]), max_gen_toks=12, do_sample=True, temperature=1.5, top_k=0)
    outs = [tuple(generate_tokens(m, [dataclasses.replace(r, seed=s)])[0]) for s in range(4)]
    assert len(set(outs)) == 4


def test_empty_stop_string_is_ignored(llama):
    # lm-eval skips empty stop strings (postprocess and stopping criteria alike): "" never ends a row or cuts text.
    plain, toks = _greedy(llama, PROMPTS[1], n=8)
    req = GenRequest(ids(llama, PROMPTS[1]), until=("",), max_gen_toks=8)
    assert generate_tokens(plain, [req])[0] == toks
    assert generate(plain, [req])[0] == plain.tokenizer.decode(toks, skip_special_tokens=True)
    assert stop_at("a\nb", ("", "\n")) == "a" and stop_at("a\nb", ()) == "a\nb"


def test_greedy_rows_are_not_temperature_scaled():
    # A greedy row (do_sample off, or temperature 0) has no temperature to divide by: its logits pass unscaled
    # (HF skips the warper), next to a sampled row that is scaled.
    logits = mx.array([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0], [1.0, 2.0, 4.0]])
    reqs = [GenRequest((1,), top_k=0, temperature=0.5), GenRequest((1,), do_sample=True, top_k=0),
            GenRequest((1,), do_sample=True, temperature=0.5, top_k=0)]  # fmt: skip
    assert warp_logits(logits, reqs).tolist() == [[1.0, 2.0, 4.0], [1.0, 2.0, 4.0], [2.0, 4.0, 8.0]]


def test_rows_match_the_batch_caches_layout(llama, monkeypatch):
    # Rows are padded-layout indices of the KV cache itself: when finished rows leave, the cache trims the left
    # padding no survivor needs, and Rows must shift with it (offset == the cache's write index, starts == its
    # left padding, so the longest survivor starts at 0), at every forward.
    import worker.generate as gen

    caches = []
    real = gen.make_batch_cache
    monkeypatch.setattr(gen, "make_batch_cache", lambda model, pads: caches.append(real(model, pads)) or caches[-1])
    seen = []

    def hook(x, ctx):
        c = caches[-1][0]
        seen.append((ctx.rows.offset, c._idx, ctx.rows.starts.tolist(), c.left_padding.tolist()))
        return x

    m = with_eos(llama, [])
    reqs = [GenRequest(ids(m, p), max_gen_toks=n) for p, n in zip(PROMPTS, (3, 9, 5, 2, 7, 4))]
    with m.hooks.installed([("resid_pre.0", hook)]):
        generate_tokens(m, reqs, batch_size=16)
    assert len(seen) == 9 and len({tuple(s[2]) for s in seen}) > 3  # rows left at several steps
    for offset, idx, starts, left in seen:
        assert (offset, starts) == (idx, left) and min(starts) == 0


def test_length_edges(llama):
    m = with_eos(llama, [])
    # max_gen_toks = max_length - 1 leaves room for one prompt token: the context keeps its last token.
    long = GenRequest(ids(m, PROMPTS[3]), max_gen_toks=m.max_length - 1)
    from worker.generate import truncate

    assert truncate(long, m.max_length).context == long.context[-1:]
    assert truncate(GenRequest((1, 2, 3), max_gen_toks=5), 8) == GenRequest((1, 2, 3), max_gen_toks=5)  # fits: as is
    # max_gen_toks = 1 generates exactly the first greedy token; 0 needs no prompt at all, 1 does.
    plain, toks = _greedy(llama, PROMPTS[1], n=4)
    assert generate_tokens(plain, [GenRequest(ids(llama, PROMPTS[1]), max_gen_toks=1)]) == [toks[:1]]
    assert generate(plain, [GenRequest((), max_gen_toks=0), GenRequest((5,), max_gen_toks=0)]) == ["", ""]
    with pytest.raises(ValueError, match="request 0 has an empty context"):
        generate_tokens(plain, [GenRequest((), max_gen_toks=1)])
    for bad in (0, -1):
        with pytest.raises(ValueError, match="batch_size must be at least 1"):
            generate_tokens(plain, [GenRequest((1,), max_gen_toks=1)], batch_size=bad)


def test_batch_size_caps_the_rows_of_every_forward(llama):
    rows = []

    def hook(x, ctx):
        rows.append((x.shape[0], x.shape[1] > 1))
        return x

    m = with_eos(llama, [])
    reqs = [GenRequest(ids(m, p), max_gen_toks=3) for p in PROMPTS[:5]]
    with m.hooks.installed([("resid_pre.0", hook)]):
        generate_tokens(m, reqs, batch_size=2)
    assert [b for b, prefill in rows if prefill] == [2, 2, 1]  # 5 requests: batches of 2, 2, 1
    assert max(b for b, _ in rows) == 2 and len(rows) == 3 * 3


def test_returned_text_drops_special_tokens(llama):
    # lm-eval decodes the continuation with skip_special_tokens: a non-EOS special token the model emits (here
    # "<s>", forced at every step) is not in the text, though it is in the token ids.
    bos = llama.tokenizer.convert_tokens_to_ids("<s>")
    first = ids(llama, " king")[-1]
    m, calls = scripted(llama, [first, bos, first, bos])
    req = GenRequest(ids(m, PROMPTS[1]), max_gen_toks=4)
    assert generate_tokens(m, [req])[0] == [first, bos, first, bos]
    calls.clear()
    text = generate(m, [req])[0]
    assert "<s>" not in text and text == m.tokenizer.decode([first, first], skip_special_tokens=True)


def test_unsupported_cache_kinds_are_refused():
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    from worker.generate import make_batch_cache

    class Stub:
        def __init__(self, caches):
            self.caches = caches

        def make_cache(self):
            return self.caches

    ok = make_batch_cache(Stub([KVCache(), RotatingKVCache(max_size=8)]), [0, 2])
    assert [type(c).__name__ for c in ok] == ["BatchKVCache", "BatchRotatingKVCache"]
    for bad in (RotatingKVCache(max_size=8, keep=4), ArraysCache(2)):  # a kept prefix; a recurrent state
        with pytest.raises(ValueError, match="supports KV and sliding-window caches only"):
            make_batch_cache(Stub([KVCache(), bad]), [0, 1])


def test_only_logits_that_are_not_finite_are_refused():
    # The step's flag is the logits' sum (one pass): a sum that overflows from finite logits is re-checked exactly.
    import mlx.core as mx

    from worker.sampling import NON_FINITE, check_finite, finite_flag

    big = mx.full((2, 8), 3e38)
    assert not finite_flag(big).item()
    check_finite(finite_flag(big), big)  # finite logits: not refused
    check_finite(finite_flag(mx.zeros((2, 8))), mx.zeros((2, 8)))
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = mx.zeros((2, 8))
        x[1, 3] = bad
        with pytest.raises(ValueError, match=NON_FINITE):
            check_finite(finite_flag(x), x)
