"""Steering-vector extraction: the capture kernel against blocks run by hand, the combine methods on planted
directions, the safetensors output, and one-line errors for bad pairs files."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask
from safetensors import safe_open
from safetensors.numpy import load_file

from testbed.inproc import Completed, driver, session_address

from driver.steering.vectors import (
    METHODS,
    Pair,
    PairsError,
    capture_requests,
    check_pairs,
    combine,
    extract,
    head_encoder,
    metadata,
    parse_layers,
    parse_position,
    read_pairs,
    write_vectors,
)
from worker.capture import capture
from worker.hooks import Capture
from worker.load import load
from worker.spec import Batching

POINTS = ["resid_pre.0", "resid_post.0", "resid_post.1", "resid_pre.2", "resid_post.2"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from testbed.models import write_model

    return load(str(write_model(tmp_path_factory.mktemp("m") / "m", arch="llama", layers=3)))


def ragged_requests(n: int = 12, seed: int = 0) -> list[tuple[tuple[int, ...], int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(3, 20))
        tokens = tuple(int(t) for t in rng.integers(3, 700, size=length))
        out.append((tokens, int(rng.choice([-1, -2, 0, length // 2]))))
    return out


def by_hand(lm, tokens, position: int) -> np.ndarray:
    """[points, hidden]: one unpadded sequence through the decoder blocks, called one by one."""
    inner = lm.model.model
    h = inner.embed_tokens(mx.array([list(tokens)]))
    mask = create_attention_mask(h, None)
    streams = {}
    for i, block in enumerate(inner.layers):
        streams[f"resid_pre.{i}"] = h
        h = block(h, mask)
        streams[f"resid_post.{i}"] = h
    return np.stack([np.array(streams[p][0, position]) for p in POINTS])


# --- capture kernel -------------------------------------------------------------------------------------


def test_capture_equals_the_blocks_run_by_hand_on_ragged_batches(lm):
    requests = ragged_requests() + [ragged_requests(1, seed=5)[0]] * 2  # a repeated request shares its row
    got = capture(lm, requests, POINTS, Batching(batch_size=5))
    assert len(got) == len(requests)
    for (tokens, position), arr in zip(requests, got):
        assert arr.dtype == np.float32 and arr.shape == (len(POINTS), 64)
        np.testing.assert_allclose(arr, by_hand(lm, tokens, position), atol=1e-5)


def test_capture_does_not_depend_on_the_batch_size(lm):
    requests = ragged_requests(16, seed=1)
    one = capture(lm, requests, POINTS, Batching(batch_size=1))
    many = capture(lm, requests, POINTS, Batching(batch_size=32))
    few_tokens = capture(lm, requests, POINTS, Batching(batch_size=32, max_batch_tokens=40))
    for a, b, c in zip(one, many, few_tokens):
        assert np.abs(a - b).max() <= 1e-6 and np.abs(a - c).max() <= 1e-6


def test_capture_sees_steering_installed_before_it_at_the_right_rows(lm):
    """A hook adding v at each row's last real token (via Rows) is seen by the capture at that point only there."""
    v = mx.array(np.full(64, 3.0, dtype=np.float32))

    def add_last(x, ctx):
        return mx.where(ctx.rows.mask("last", x.shape[0], x.shape[1])[..., None], x + v, x)

    requests = [(tuple(range(5, 5 + n)), p) for n in (4, 9, 6) for p in (-1, -2)]
    plain = capture(lm, requests, ["resid_post.0", "resid_post.2"], Batching(batch_size=3))
    with lm.hooks.installed([("resid_post.0", add_last)]):
        steered = capture(lm, requests, ["resid_post.0", "resid_post.2"], Batching(batch_size=3))
    for (_, position), p, s in zip(requests, plain, steered):
        expected = 3.0 if position == -1 else 0.0  # pads never count as a row's last token
        np.testing.assert_allclose(s[0] - p[0], expected, atol=1e-5)
        assert (np.abs(s[1] - p[1]).max() > 1e-3) == (position == -1)


def test_capture_keeps_the_last_max_length_tokens(lm, tmp_path):
    short = load(str(lm.path), max_length=8)
    tokens = tuple(range(10, 22))
    got = capture(short, [(tokens, -1), (tokens, 4), (tokens, -8)], POINTS)
    np.testing.assert_allclose(got[0], by_hand(lm, tokens[-8:], -1), atol=1e-5)
    np.testing.assert_allclose(got[1], by_hand(lm, tokens[-8:], 0), atol=1e-5)  # token 4 is the window's first
    np.testing.assert_allclose(got[2], got[1], atol=0)
    with pytest.raises(ValueError, match=r"^request 0: position 3 falls in the first 4 of its 12 tokens, cut off") as e:
        capture(short, [(tokens, 3)], POINTS)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("position", [5, -6])
def test_capture_refuses_a_position_outside_the_tokens(lm, position):
    with pytest.raises(ValueError, match=rf"^request 1: position {position} is outside its 5 tokens$"):
        capture(lm, [((1, 2, 3, 4, 5, 6), -1), ((1, 2, 3, 4, 5), position)], POINTS)


# --- combining ------------------------------------------------------------------------------------------


def planted(n: int = 64, d: int = 32, seed: int = 0):
    """Pairs sharing a large random base, pulled apart along u by a varying amount, plus small noise."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    base = 3.0 * rng.standard_normal((n, d))
    scale = rng.uniform(1.0, 3.0, size=(n, 1))
    pos = base + scale * u / 2 + 0.05 * rng.standard_normal((n, d))
    neg = base - scale * u / 2 + 0.05 * rng.standard_normal((n, d))
    return pos.astype(np.float32), neg.astype(np.float32), u, float(scale.mean())


@pytest.mark.parametrize("method", METHODS)
def test_each_method_recovers_a_planted_direction_with_its_sign(method):
    pos, neg, u, mean_scale = planted()
    v = combine(pos, neg, method)
    assert v.dtype == np.float32 and v.shape == u.shape
    assert float(v @ u) / np.linalg.norm(v) > 0.99
    if method == "mean-diff":
        assert np.linalg.norm(v) == pytest.approx(mean_scale, rel=0.02)  # natural scale kept
    else:
        assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-6)
    flipped = combine(neg, pos, method)
    assert float(flipped @ u) / np.linalg.norm(flipped) < -0.99  # swapping the sides flips the sign
    assert np.array_equal(combine(pos.copy(), neg.copy(), method), v)  # deterministic, bitwise


def test_mean_diff_is_the_float64_mean_of_the_differences():
    pos, neg, _, _ = planted(n=7, d=5, seed=3)
    expected = (pos.astype(np.float64) - neg.astype(np.float64)).mean(axis=0).astype(np.float32)
    assert np.array_equal(combine(pos, neg, "mean-diff"), expected)


def test_pca_diff_refuses_differences_that_do_not_vary():
    pos = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="do not vary"):
        combine(pos, np.zeros((4, 3), np.float32), "pca-diff")
    with pytest.raises(ValueError, match="at least 2 pairs"):
        combine(pos[:1], pos[:1] * 0, "pca-diff")
    # pca-center sees a shift shared by every pair
    assert np.allclose(combine(pos, np.zeros((4, 3), np.float32), "pca-center"), 3**-0.5)


# --- extraction on the real model -----------------------------------------------------------------------


def test_planted_pairs_mean_diff_equals_captures_made_one_by_one(lm):
    """Pairs differing in one word: extract's vector is the mean of per-text last-token captures' differences."""
    words = [("happy", "sad"), ("big", "small"), ("red", "blue"), ("king", "queen")]
    pairs = [Pair(f" the {a} dog", f" the {b} dog", prompt="Once upon a time") for a, b in words]
    encode = lm.tokenizer.encode
    layers = parse_layers("1,-1", lm.n_layers)
    vectors = extract(
        lambda requests, points: capture(lm, requests, points, Batching(batch_size=3)),
        encode, pairs, layers, "resid_post", "mean-diff", parse_position("last"),
    )
    assert sorted(vectors) == ["resid_post.1", "resid_post.2"]
    for layer in layers:
        diffs = []
        for pair in pairs:
            last = []
            for text in pair.texts:
                cap = Capture("last")  # the hooks module's own capture, one unpadded text at a time
                with lm.hooks.installed([(f"resid_post.{layer}", cap)]):
                    mx.eval(lm.model(mx.array([encode(text)])))
                last.append(np.array(cap.records[0][0], dtype=np.float64))
            diffs.append(last[0] - last[1])
        expected = np.mean(diffs, axis=0)
        assert np.linalg.norm(expected) > 0.1
        np.testing.assert_allclose(vectors[f"resid_post.{layer}"], expected, atol=1e-5)


def test_capture_requests_put_positives_first():
    pairs = [Pair("a", "b", prompt="p"), Pair("c", "d")]
    requests = capture_requests(lambda s: [ord(c) for c in s], pairs, -1)
    assert requests == [((112, 97), -1), ((99,), -1), ((112, 98), -1), ((100,), -1)]
    with pytest.raises(ValueError, match=r"^pair 2: position -2 is outside the 1 tokens of its positive text$"):
        capture_requests(lambda s: [ord(c) for c in s], pairs, -2)
    with pytest.raises(PairsError, match=r"^pair 1: position 0 falls in the first 1 tokens, cut off to fit the model's"):
        capture_requests(lambda s: [ord(c) for c in s], pairs, 0, max_length=1)
    assert capture_requests(lambda s: [ord(c) for c in s], pairs, -1, max_length=1) == requests  # the last token stays


# --- output ---------------------------------------------------------------------------------------------


def test_vectors_file_round_trips_with_metadata(tmp_path):
    rng = np.random.default_rng(0)
    vectors = {"resid_post.1": rng.standard_normal(64).astype(np.float32), "resid_post.2": rng.standard_normal(64)}
    meta = metadata("tiny-llama@abc", "mean-diff", "resid_post", -1, [Pair("a", "b")], fingerprint="abc")
    path = write_vectors(tmp_path / "new" / "dir" / "v.safetensors", vectors, meta)  # parents are created
    loaded = load_file(str(path))
    assert loaded.keys() == vectors.keys()
    for k, v in vectors.items():
        assert loaded[k].dtype == np.float32 and np.array_equal(loaded[k], v.astype(np.float32))
    with safe_open(str(path), "np") as f:
        stored = f.metadata()
    assert stored == meta
    assert {"model", "method", "site", "position", "n_pairs", "pairs_sha256", "orchard_version"} <= stored.keys()
    assert stored["n_pairs"] == "1" and stored["position"] == "-1" and len(stored["pairs_sha256"]) == 64
    assert [p.name for p in path.parent.iterdir()] == ["v.safetensors"]  # no temp file left behind


def test_a_failed_write_leaves_the_previous_file_and_no_temp(tmp_path, monkeypatch):
    path = write_vectors(tmp_path / "v.safetensors", {"resid_post.0": np.ones(4, np.float32)}, {})
    before = path.read_bytes()
    write_bytes = Path.write_bytes

    def half_written(self, data):
        write_bytes(self, data[:7])
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_bytes", half_written)
    with pytest.raises(OSError, match="disk full"):
        write_vectors(path, {"resid_post.0": np.zeros(4, np.float32)}, {})
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["v.safetensors"]
    with pytest.raises(ValueError, match=r"^output path is a folder: .*$"):
        write_vectors(tmp_path, {"resid_post.0": np.zeros(4, np.float32)}, {})


# --- inputs ---------------------------------------------------------------------------------------------


def test_read_pairs_reads_prompts_and_skips_blank_lines(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"positive": " yes", "negative": " no", "prompt": "Q?"}\n\n{"positive": "a", "negative": "b"}\n')
    pairs = read_pairs(path)
    assert pairs == [Pair(" yes", " no", "Q?"), Pair("a", "b")]
    assert pairs[0].texts == ("Q? yes", "Q? no")


GOOD = '{"positive": "a", "negative": "b"}'


@pytest.mark.parametrize(
    "content, line, message",
    [
        (f'{GOOD}\n{{"positive": "a", "negative": "b"\n', 2, "not valid JSON"),
        (f'{GOOD}\n\n{{"negative": "b"}}\n', 3, "missing field 'positive'"),
        (f'{GOOD}\n{{"positive": "a", "negative": ""}}\n', 2, "empty field 'negative'"),
        (f'{{"positive": "a", "negative": 3}}\n', 1, "field 'negative' must be a string, not int"),
        (f'{{"positive": "a", "negative": "b", "prompt": null}}\n', 1, "field 'prompt' must be a string"),
        (f'{GOOD}\n{{"positive": "a", "negative": "b", "label": 1}}\n', 2, "unknown field 'label'"),
        (f'{GOOD}\n["a", "b"]\n', 2, "expected a JSON object"),
    ],
)
def test_each_pairs_file_error_is_one_line_with_its_line_number(tmp_path, content, line, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(content)
    with pytest.raises(PairsError) as e:
        read_pairs(path)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{path}: line {line}: ") and message in text


def test_missing_and_empty_pairs_files_are_one_line_errors(tmp_path):
    with pytest.raises(PairsError, match=r"^pairs file not found: .*nope\.jsonl$"):
        read_pairs(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(PairsError, match=r"empty\.jsonl: no pairs \(the file is empty\)"):
        read_pairs(tmp_path / "empty.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes('{"positive": "caf\u00e9", "negative": "b"}'.encode("latin-1"))
    with pytest.raises(PairsError, match=r"latin1\.jsonl: not UTF-8 text \(bad byte at offset 17\)$"):
        read_pairs(tmp_path / "latin1.jsonl")


def test_parse_layers_and_position():
    assert parse_layers("all", 3) == [0, 1, 2]
    assert parse_layers(" 2, 0 ", 3) == [2, 0]
    assert parse_layers("-1,-3", 3) == [2, 0]
    bad = [("3", "out of range"), ("-4", "out of range"), ("1,x", "bad layer 'x'"), ("", "bad layer"), ("1,-2", "twice")]
    for spec, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_layers(spec, 3)
    assert parse_position("last") == -1 and parse_position("-2") == -2 and parse_position("5") == 5
    with pytest.raises(ValueError, match="bad position 'first'"):
        parse_position("first")


# --- what the head checks before any capture, and degenerate vectors ------------------------------------------------


def write_pairs(path, *lines) -> list[Pair]:
    path.write_text("".join(json.dumps(line) + "\n" if line else "\n" for line in lines))
    return read_pairs(path)


HAPPY = {"positive": "Once upon a time the dog was happy", "negative": "Once upon a time the dog was sad"}


def test_the_head_tokenizes_as_the_run_does(stories_path):
    from driver.lm.mlx import MLXLM

    lm = MLXLM(pretrained=str(stories_path))
    encode = head_encoder(stories_path)
    for text in ["Once upon a time", "<s> Lily", " spaced  out ", "Tom\nran"]:
        assert encode(text) == lm.tok_encode(text)


@pytest.mark.parametrize(
    "lines, method, position, max_length, message",
    [
        ([HAPPY], "pca-diff", -1, 512, "pairs.jsonl: pca-diff needs at least 2 pairs (it finds how they vary), the file has 1"),
        ([HAPPY], "pca-center", -1, 512, "pairs.jsonl: pca-center needs at least 2 pairs"),
        ([HAPPY, None, {"positive": "Once upon a time", "negative": "Tom"}], "mean-diff", -5, 512,
         "pairs.jsonl: line 3: position -5 is outside the 3 tokens of its negative text"),
        ([HAPPY], "mean-diff", -500, 512, "pairs.jsonl: line 1: position -500 is outside the 10 tokens of its positive text"),
        ([HAPPY], "mean-diff", 2, 4, "pairs.jsonl: line 1: position 2 falls in the first 6 tokens, cut off to fit the model's context of 4"),
        ([HAPPY, {"positive": "same", "negative": "same"}, {"prompt": "a", "positive": "b", "negative": "b"}], "mean-diff", -1, 512,
         "pairs.jsonl: line 2: the positive and negative texts are the same tokens (so are lines 3), so their difference is zero"),
    ],
)
def test_the_head_refuses_pairs_it_can_see_are_unusable(stories_path, tmp_path, lines, method, position, max_length, message):
    path = tmp_path / "pairs.jsonl"
    with pytest.raises(PairsError) as e:
        check_pairs(path, write_pairs(path, *lines), head_encoder(stories_path), method, position, max_length)
    assert message in str(e.value) and str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_texts_longer_than_the_context_are_counted_once(stories_path, tmp_path, capsys):
    path = tmp_path / "pairs.jsonl"
    pairs = write_pairs(path, HAPPY, {"positive": "a dog", "negative": "a cat"})
    check_pairs(path, pairs, head_encoder(stories_path), "mean-diff", -1, 8)
    err = capsys.readouterr().err
    assert err == "warning: 2 of 4 pair texts are longer than the model's context (8 tokens); the capture reads their last 8 tokens\n"
    check_pairs(path, pairs, head_encoder(stories_path), "mean-diff", -1, 512)
    assert capsys.readouterr().err == ""


def test_vectors_that_would_be_zero_are_refused_naming_layers_and_pairs(lm):
    """Position 0 is the BOS token on both sides: every layer's activations are equal, so is every pair's."""
    pairs = [Pair(" the happy dog", " the sad dog", line=2), Pair(" a big cat", " a small cat", line=5)]
    capture_fn = lambda requests, points: capture(lm, requests, points)  # noqa: E731
    with pytest.raises(PairsError) as e:
        extract(capture_fn, lm.tokenizer.encode, pairs, [0, 2], "resid_post", "mean-diff", 0)
    assert str(e.value) == (
        "the vectors at resid_post.0, resid_post.2 would be zero (under 0.0001 of the activations' norm): the pairs "
        "on lines 2, 5 read the same activations on both sides at position 0; make their positive and negative "
        "texts differ there; nothing written"
    )
    swapped = [pairs[0], Pair(" the sad dog", " the happy dog", line=3)]  # differences that cancel out
    with pytest.raises(PairsError, match=r"resid_post\.0, resid_post\.2 would be zero .*: the pairs' differences cancel out"):
        extract(capture_fn, lm.tokenizer.encode, swapped, [0, 2], "resid_post", "mean-diff", -1)
    found = extract(capture_fn, lm.tokenizer.encode, swapped, [0, 2], "resid_post", "pca-center", -1)
    assert all(np.isclose(np.linalg.norm(v), 1.0) for v in found.values())  # a direction exists: PCA finds it


# --- the CLI: cached like every result, degenerate output refused ---------------------------------------------------


def _vectors(*args, cwd) -> Completed:
    """`driver vectors ARGS` in this process on one worker of the session's cluster (the test uses `ray_cluster`)."""
    return driver("vectors", "--workers", "1", "--address", session_address(), *args, cwd=cwd, env={"HF_HUB_OFFLINE": "1"})


def _contents(path) -> tuple[dict, dict]:
    with safe_open(str(path), "np") as f:
        return f.metadata(), {k: f.get_tensor(k).tobytes() for k in f.keys()}


@pytest.mark.usefixtures("ray_cluster")
def test_vectors_are_cached_a_rerun_computes_nothing_a_changed_pair_only_itself(stories_path, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    lines = [HAPPY, {"positive": "Tom was glad", "negative": "Tom was angry"}, {"positive": "a sunny day", "negative": "a rainy day"}]
    write_pairs(pairs, *lines)
    out = tmp_path / "out" / "v.safetensors"
    first = _vectors("--model", stories_path, "--pairs", pairs, "--out", out, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"(0 of 6 texts from the cache, {tmp_path / 'out' / 'cache'})" in first.stdout, first.stdout
    first_copy = tmp_path / "first.safetensors"
    first_copy.write_bytes(out.read_bytes())
    again = _vectors("--model", stories_path, "--pairs", pairs, "--out", out, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "(6 of 6 texts from the cache" in again.stdout and "on no workers" in again.stdout, again.stdout
    assert _contents(out) == _contents(first_copy)  # the same vectors, bit for bit, and the same metadata
    write_pairs(pairs, *lines[:2], {"positive": "a sunny day", "negative": "a foggy day"})
    changed = _vectors("--model", stories_path, "--pairs", pairs, "--out", out, cwd=tmp_path)
    assert changed.returncode == 0 and "(5 of 6 texts from the cache" in changed.stdout, changed.stdout + changed.stderr[-2000:]
    assert _contents(out)[1] != _contents(first_copy)[1]


@pytest.mark.usefixtures("ray_cluster")
def test_vectors_that_would_be_zero_write_nothing(stories_path, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    write_pairs(pairs, HAPPY, {"positive": "Tom was glad", "negative": "Tom was angry"})
    out = tmp_path / "v.safetensors"
    proc = _vectors("--model", stories_path, "--pairs", pairs, "--out", out, "--position", "0", "--layers", "0,-1", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (  # known from the tokens (BOS on both sides), before Ray (issue 29.4)
        f"Error: {pairs}: the positive and negative texts of every pair agree on every token up to position 0, so the "
        "activations read there are the same and every vector would be zero: read a position where the texts differ "
        "(e.g. --position last)"
    )
    assert not out.exists()


# --- capture at the branch sites ------------------------------------------------------------------------

BRANCH_POINTS = ["resid_pre.1", "attn_out.1", "resid_mid.1", "mlp_out.1", "resid_post.1"]


def branches_by_hand(lm, tokens, position: int) -> np.ndarray:
    """[5, hidden]: block 1's input, attention output, mid residual, MLP output and output, its parts called by hand."""
    inner = lm.model.model
    h = inner.embed_tokens(mx.array([list(tokens)]))
    mask = create_attention_mask(h, None)
    h = inner.layers[0](h, mask)
    b = inner.layers[1]
    attn = b.self_attn(b.input_layernorm(h), mask)
    mid = h + attn
    mlp = b.mlp(b.post_attention_layernorm(mid))
    return np.stack([np.array(s[0, position]) for s in (h, attn, mid, mlp, mid + mlp)])


def test_branch_captures_equal_the_blocks_parts_by_hand_at_any_batch_size(lm):
    requests = ragged_requests(10, seed=3)
    one = capture(lm, requests, BRANCH_POINTS, Batching(batch_size=1))
    many = capture(lm, requests, BRANCH_POINTS, Batching(batch_size=32))
    for (tokens, position), a, b in zip(requests, one, many):
        np.testing.assert_allclose(a, branches_by_hand(lm, tokens, position), atol=1e-5)
        assert np.abs(a - b).max() <= 1e-6
        assert np.array_equal(a[2], a[0] + a[1])  # resid_mid is resid_pre + attn_out, bit for bit


@pytest.mark.usefixtures("ray_cluster")
def test_driver_vectors_at_each_site_keys_site_and_layer_and_steers_from_a_spec(stories_path, tmp_path):
    from driver.steering.spec import for_model

    pairs = tmp_path / "pairs.jsonl"
    write_pairs(pairs, HAPPY, {"positive": "Tom was glad", "negative": "Tom was angry"})
    found = {}
    for site in ("resid_pre", "attn_out", "resid_mid", "mlp_out"):  # one cache: each site its own activations
        out = tmp_path / f"{site}.safetensors"
        proc = _vectors("--model", stories_path, "--pairs", pairs, "--out", out, "--site", site, "--layers", "1", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        with safe_open(str(out), "np") as f:
            assert list(f.keys()) == [f"{site}.1"] and f.metadata()["site"] == site
            found[site] = f.get_tensor(f"{site}.1")
    # mean-diff is linear in the activations, and resid_mid = resid_pre + attn_out
    np.testing.assert_allclose(found["resid_mid"], found["resid_pre"] + found["attn_out"], atol=1e-5)
    assert np.abs(found["attn_out"] - found["mlp_out"]).max() > 1e-3
    spec = {"interventions": [{"layer": 1, "site": "attn_out", "vector": {"file": str(tmp_path / "attn_out.safetensors")}}]}
    config = json.loads((stories_path / "config.json").read_text())
    steering = for_model(spec, config, base_dir=tmp_path).steering
    assert np.array_equal(np.asarray(steering.interventions[0].vector, np.float32), found["attn_out"])


# --- capture at attn_head: one vector per layer and head ---------------------------------------------------------


@pytest.mark.usefixtures("ray_cluster")
def test_driver_vectors_at_attn_head_keys_layer_and_head_and_steers_from_a_spec(stories_path, tmp_path):
    from driver.steering.spec import for_model

    pairs = tmp_path / "pairs.jsonl"
    read = write_pairs(pairs, HAPPY, {"positive": "Tom was glad", "negative": "Tom was angry"})
    out = tmp_path / "heads.safetensors"
    proc = _vectors("--model", stories_path, "--pairs", pairs, "--out", out, "--site", "attn_head", "--heads", "0,7",
                    "--layers", "1,3", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    with safe_open(str(out), "np") as f:
        assert list(f.keys()) == ["attn_head.1.0", "attn_head.1.7", "attn_head.3.0", "attn_head.3.7"]
        assert (f.metadata()["site"], f.metadata()["heads"], f.metadata()["head_dim"]) == ("attn_head", "0,7", "8")
        got = {k: f.get_tensor(k) for k in f.keys()}
    # each head's mean-diff is that head's slice (8 values of the 64 the output projection reads) of the pairs' captures
    lm = load(str(stories_path))
    acts = np.stack(capture(lm, capture_requests(head_encoder(stories_path), read, -1), ["attn_head.1", "attn_head.3"]))
    diff = (acts[:2] - acts[2:]).astype(np.float64).mean(axis=0)
    for j, layer in enumerate((1, 3)):
        for head in (0, 7):
            np.testing.assert_allclose(got[f"attn_head.{layer}.{head}"], diff[j, head * 8:(head + 1) * 8], atol=1e-5)
    spec = {"interventions": [{"layer": 3, "site": "attn_head", "head": 7, "vector": {"file": str(out)}}]}
    config = json.loads((stories_path / "config.json").read_text())
    steering = for_model(spec, config, base_dir=tmp_path).steering
    assert np.array_equal(np.asarray(steering.interventions[0].vector, np.float32), got["attn_head.3.7"])
