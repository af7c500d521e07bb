"""Instrumented decoder blocks: bitwise no-op, exact interventions, per-row positions, pads untouched."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask
from mlx_lm.utils import load as mlx_load

from worker.hooks import Capture, Rows, instrument
from worker.load import load
from worker.score import loglikelihood
from worker.spec import Batching
from worker.steer import Add, Replace

TOKENS = [[1, 17, 33, 250, 9, 71, 200, 12]]  # below the coverage models' vocabulary of 256: MLX reads past a table


@pytest.fixture(scope="module")
def lm(model_path):
    return load(str(model_path))


def width(lm) -> int:
    """The residual stream's size, read off a capture."""
    cap = Capture("last")
    with lm.hooks.installed([("resid_pre.0", cap)]):
        lm.model(mx.array([[1]]))
    return cap.records[0].shape[-1]


def test_no_interventions_is_bitwise_the_plain_model(model_path, lm):
    plain, _ = mlx_load(str(model_path))
    x = mx.array(TOKENS)
    assert mx.array_equal(plain(x), lm.model(x)).item()
    assert type(lm.model.layers[0]).__mro__[1] is type(plain.layers[0])  # same block class underneath
    assert instrument(lm.model) is lm.hooks  # idempotent: no second wrapper
    assert dict(lm.model.parameters()).keys() == dict(plain.parameters()).keys()  # weight names kept


def test_unknown_hook_point_is_refused(lm):
    with pytest.raises(ValueError, match="unknown hook point 'resid_middle.0': use resid_pre.L, resid_mid.L, resid_post.L, attn_out.L, mlp_out.L, attn_head.L"):
        lm.hooks.add("resid_middle.0", Capture())
    for point in ("resid_mid", "attn_out", "mlp_out", "attn_head"):
        lm.hooks.remove(point + ".0", lm.hooks.add(point + ".0", Capture()))
    with pytest.raises(ValueError, match="unknown hook point"):
        lm.hooks.add(f"resid_post.{lm.hooks.n_layers}", Capture())


def test_add_equals_running_the_blocks_by_hand(llama_path):
    lm = load(str(llama_path))
    inner, layer, alpha = lm.model.model, 1, 2.5
    v = np.random.default_rng(0).standard_normal(inner.embed_tokens.weight.shape[1]).astype(np.float32)
    x = mx.array(TOKENS)
    h = inner.embed_tokens(x)
    mask = create_attention_mask(h, None)
    for i, block in enumerate(inner.layers):
        h = block(h, mask)
        if i == layer:
            h = h + alpha * mx.array(v)
    manual = lm.model.lm_head(inner.norm(h))
    with lm.hooks.installed([(f"resid_post.{layer}", Add(v, alpha))]):
        steered = lm.model(x)
    assert mx.allclose(steered, manual, atol=1e-5).item()
    assert not mx.allclose(steered, lm.model(x), atol=1e-2).item()


def test_capture_returns_the_residual_stream(llama_path):
    lm = load(str(llama_path))
    x = mx.array(TOKENS)
    pre0, post0 = Capture("all"), Capture("last")
    with lm.hooks.installed([("resid_pre.0", pre0), ("resid_post.0", post0)]):
        lm.model(x)
    embeddings = lm.model.model.embed_tokens(x)
    assert mx.array_equal(pre0.records[0][0], embeddings[0]).item()
    by_hand = lm.model.model.layers[0](embeddings, create_attention_mask(embeddings, None))
    assert mx.allclose(post0.records[0], by_hand[:, -1, :], atol=1e-6).item()


class Snapshot:
    """Test hook: keep the whole hooked tensor, pads included."""

    def __init__(self):
        self.seen = []

    def __call__(self, x, ctx):
        self.seen.append((np.array(x), ctx.rows))
        return x


@pytest.mark.parametrize("positions", ["all", "last", "prompt", "continuation"])
def test_right_padded_batch_positions_and_untouched_pads(lm, positions):
    """Rows of lengths 3, 6, 8 in one right-padded forward: each row's own positions change, pads never."""
    reqs = [([1, 5], [9]), ([1, 5, 6, 7, 8], [9]), ([1, 5, 6, 7, 8, 10, 11], [9])]
    v = np.ones(width(lm), np.float32)
    before, after = Snapshot(), Snapshot()
    with lm.hooks.installed([("resid_pre.1", before), ("resid_pre.1", Add(v, 1.0, positions)), ("resid_pre.1", after)]):
        loglikelihood(lm, reqs, Batching(prefix_reuse=False))
    (x0, _), (x1, _) = before.seen[0], after.seen[0]
    changed = np.abs(x1 - x0).max(axis=-1) > 0  # [B, S]
    lengths = [len(c) for c, _ in reqs]  # one-token continuations: the input is the context
    expected = np.zeros_like(changed)
    for b, n in enumerate(lengths):
        if positions in ("all", "prompt"):
            expected[b, :n] = True
        elif positions == "last":
            expected[b, n - 1] = True
    assert (changed == expected).all(), (positions, changed.astype(int))


def test_generation_layout_rows_mask():
    """Left padding (generation): starts/ends/prompt_ends pick prompt vs continuation (generated) tokens per row."""
    rows = Rows(offset=0, starts=mx.array([2, 0]), ends=mx.array([6, 6]), prompt_ends=mx.array([4, 4]))
    m = lambda p: np.array(rows.mask(p, 2, 6)).astype(int).tolist()  # noqa: E731
    assert m("all") == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert m("prompt") == [[0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert m("continuation") == [[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1]]
    assert m("last") == [[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1]]
    with pytest.raises(ValueError, match="unknown positions"):
        rows.mask("middle", 2, 6)


def test_replace_and_interpolate(lm):
    x = mx.array(TOKENS)
    v = np.full(width(lm), 3.0, np.float32)
    for weight in (1.0, 0.5):
        before, after = Snapshot(), Snapshot()
        with lm.hooks.installed([("resid_post.0", before), ("resid_post.0", Replace(v, weight, "last")), ("resid_post.0", after)]):
            lm.model(x)
        old, new = before.seen[0][0][0], after.seen[0][0][0]
        assert np.allclose(new[-1], old[-1] + weight * (v - old[-1]), atol=1e-6)
        assert np.array_equal(new[:-1], old[:-1])  # only the last token moved
        if weight == 1.0:
            assert np.array_equal(new[-1], v)  # replaced exactly


def test_steering_is_the_same_with_and_without_prefix_reuse(lm):
    rng = np.random.default_rng(3)
    shared = [1] + [int(t) for t in rng.integers(3, 600, 40)]
    reqs = [(shared + [int(t) for t in rng.integers(3, 600, 5 + i)], [int(rng.integers(3, 600))]) for i in range(6)]
    v = rng.standard_normal(width(lm)).astype(np.float32)
    with lm.hooks.installed([("resid_post.0", Add(v, 4.0, "all"))]):
        reused = loglikelihood(lm, reqs, Batching(prefix_reuse=True))
        plain = loglikelihood(lm, reqs, Batching(prefix_reuse=False))
    unsteered = loglikelihood(lm, reqs)
    assert max(abs(a[0] - b[0]) for a, b in zip(reused, plain)) < 1e-4
    assert max(abs(a[0] - b[0]) for a, b in zip(reused, unsteered)) > 1e-2


# --- which hook points a model has, per layer, known before any worker loads it -------------------------------


def tiny_family(family: str):
    """(config.json dict, built model with evaluated random weights) of a tiny mlx-lm `family` model, from the
    coverage bench's per-family args (bench/coverage_args.py: 4 layers, hidden 64)."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import coverage_sites

    assert max(map(max, TOKENS)) < coverage_sites.VOCAB  # in range of every family's embedding table
    return coverage_sites.tiny_config(family), coverage_sites.build(family)


def refusal(hooks, name: str) -> str:
    from worker.hooks import HookError

    with pytest.raises(HookError) as e:
        with hooks.installed([(name, Capture("last"))]):
            pass
    assert "\n" not in str(e.value) and not hooks.active
    return str(e.value)


def test_a_hybrid_has_attention_sites_exactly_at_its_attention_layers():
    """qwen3_next (tiny: layers 0-2 linear attention, 3 full attention): attn_out, attn_head and resid_mid work at
    layer 3 and are refused at 0-2 in one line naming the layers that have them; the residual sites work everywhere."""
    _, model = tiny_family("qwen3_next")
    hooks = instrument(model)
    x = mx.array(TOKENS)
    plain = model(x)
    for site in ("attn_out", "attn_head", "resid_mid"):
        assert refusal(hooks, f"{site}.2") == (
            f"{site}.2: the qwen3_next block at layer 2 has no {site} ("
            + ("resid_mid follows an attention branch: " if site == "resid_mid" else "")
            + "its token mixer is Qwen3NextGatedDeltaNet (linear_attn), not attention); layers with one: 3"
        )
        cap = Capture("last")
        with hooks.installed([(f"{site}.3", cap)]), hooks.forward(Rows()):
            assert mx.allclose(model(x), plain, atol=1e-5).item()  # bitwise: tests/test_architectures (fresh processes)
        shift = mx.ones((cap.records[0].shape[-1],))
        with hooks.installed([(f"{site}.3", lambda y, ctx: y + shift)]), hooks.forward(Rows()):
            assert not mx.allclose(model(x), plain, atol=1e-4).item(), site
    with hooks.installed([("mlp_out.2", Capture("last")), ("resid_post.2", Capture("last"))]), hooks.forward(Rows()):
        model(x)


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "jamba", "lfm2", "nemotron_h", "falcon_h1", "phi", "dbrx",
                                    "granitemoehybrid", "longcat_flash", "deepseek_v41", "gemma3n", "iquestloopcoder"])
def test_the_heads_check_says_what_the_workers_hooks_will_say(family):
    """worker.hooks.skeleton builds the blocks from config.json alone (no weights, nothing evaluated) and reads the
    hooks' own per-layer `missing`: the same as instrumenting the real model, never a silent fallback to the rules."""
    from worker.hooks.skeleton import missing_sites
    from worker.spec import missing_sites as config_rules

    config, model = tiny_family(family)
    assert missing_sites(config) == {**config_rules(config), **instrument(model).missing}
    if family in ("deepseek_v41", "gemma3n", "iquestloopcoder"):  # residual stream not [batch, seq, hidden] / parts run
        assert "copies wide" in missing_sites(config)["resid_pre"] or family == "iquestloopcoder"
        assert ("attn_out" in missing_sites(config)) == (family == "iquestloopcoder")


def test_the_skeleton_evaluates_nothing():
    """A 1024-wide llama's blocks built for the check allocate none of its weights (MLX arrays stay unevaluated)."""
    from worker.hooks.skeleton import skeleton

    config = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "vocab_size": 32000,
              "quantization": {"group_size": 64, "bits": 4}}  # fmt: skip
    mx.clear_cache()
    before = mx.get_active_memory()
    model = skeleton(config)
    assert len(model.layers) == 4 and model.layers[0].mlp.up_proj.weight.shape == (4096, 1024)  # unquantized
    assert mx.get_active_memory() - before < 2**20  # the weights alone would be ~300 MB


def test_the_driver_refuses_a_site_at_a_layer_without_it_before_any_worker_starts(tmp_path):
    from driver.checks.errors import Refused
    from driver.checks.model import check_site
    from driver.steering.spec import SteeringError, for_model

    config, _ = tiny_family("qwen3_next")
    np.save(tmp_path / "v.npy", np.ones(64, np.float32))
    spec = {"interventions": [{"layer": 1, "site": "attn_out", "vector": "v.npy"}]}
    with pytest.raises(SteeringError) as e:
        for_model(spec, config, base_dir=tmp_path)
    assert str(e.value) == ("steering spec (dict): interventions[0].site: the qwen3_next block at layer 1 has no attn_out "
                            "(its token mixer is Qwen3NextGatedDeltaNet (linear_attn), not attention); layers with one: 3")
    spec["interventions"][0]["layer"] = -1  # layer 3
    assert for_model(spec, config, base_dir=tmp_path).steering.interventions[0].layer == 3
    with pytest.raises(Refused, match=r"^--site resid_mid: the qwen3_next block at layer 0 has no resid_mid"):
        check_site(config, "resid_mid", [3, 0])
    check_site(config, "resid_mid", [3])
    gemma3n, _ = tiny_family("gemma3n")
    with pytest.raises(Refused, match=r"^--site resid_post: the gemma3n block has no resid_post: its residual stream is several AltUp copies"):
        check_site(gemma3n, "resid_post", [1])
