"""Steering through the real kernels: every op at every positions mode equals running the blocks by hand.

The reference (`by_hand`) runs one request alone, unpadded, block by block, and edits the residual stream in
numpy at the positions the mode names in that request's own tokens: prompt = the context tokens, continuation
= the continuation tokens fed as input, last = the last input token.
"""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask

from testbed.models import write_model
from worker.generate import GenRequest, generate_tokens
from worker.hooks import HookContext, Rows
from worker.load import load
from worker.score import loglikelihood
from worker.spec import SITES, Batching, Intervention, Steering
from worker.steer import Ablate, Add, Clamp, Replace, SteeringError, hidden_size, hooks_for, steered

LAYERS, D = 3, 64
ALPHA = {"add": 3.0, "replace": 0.5, "ablate": 1.0, "clamp": 4.0}
# Different lengths (pads in one batch), multi-token continuations, and one single-token continuation
# (no continuation position fed as input).
REQUESTS = [
    ([1, 17, 33, 250, 9], [71, 400, 12]),
    ([1, 5, 6, 7, 8, 10, 11, 13, 14, 90, 91], [300, 301]),
    ([1, 44, 45], [46]),
    ([1, 60, 61, 62, 63, 64, 65, 66], [70, 71, 72, 73]),
]
NO_REUSE = Batching(prefix_reuse=False)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load(str(write_model(tmp_path_factory.mktemp("steer") / "llama3", arch="llama", layers=LAYERS, hidden=D)))


def vec(seed=0, scale=1.0):
    return np.random.default_rng(seed).standard_normal(D).astype(np.float32) * scale


def iv(op="add", layer=1, positions="all", site="resid_post", seed=0, alpha=None, **kw):
    alpha = ALPHA[op] if alpha is None else alpha
    v = tuple(map(float, vec(seed)))
    return Intervention(layer=layer, site=site, op=op, vector=v, alpha=alpha, positions=positions, **kw)


def selected(positions: str, n_ctx: int, n: int) -> list[int]:
    """Indices of the request's own input tokens a positions mode names."""
    spans = {"all": (0, n), "prompt": (0, n_ctx), "continuation": (n_ctx, n), "last": (n - 1, n)}
    return list(range(*spans[positions]))


def op_by_hand(op: str, x: np.ndarray, v: np.ndarray, alpha: float) -> np.ndarray:
    if op == "add":
        return x + alpha * v
    if op == "replace":
        return x + alpha * (v - x)
    u = v / np.linalg.norm(v)
    if op == "ablate":
        return x - np.outer(x @ u, u)
    return x + np.outer(alpha - x @ u, u)


def hidden_by_hand(lm, tokens, interventions, n_ctx):
    """Final hidden states of one unpadded row, the blocks run one by one, the edits made in numpy."""
    inner = lm.model.model
    h = inner.embed_tokens(mx.array([tokens]))
    mask = create_attention_mask(h, None)

    def edit(h, site, layer):
        x = np.array(h[0])
        for i in interventions:
            if i.site == site and i.layer % LAYERS == layer:
                at = selected(i.positions, n_ctx, len(tokens))
                x[at] = op_by_hand(i.op, x[at], i.array(), i.alpha)
        return mx.array(x)[None]

    for layer, b in enumerate(inner.layers):  # llama's block, its parts called one by one, each site edited
        h = edit(h, "resid_pre", layer)
        mid = edit(h + edit(b.self_attn(b.input_layernorm(h), mask), "attn_out", layer), "resid_mid", layer)
        h = edit(mid + edit(b.mlp(b.post_attention_layernorm(mid)), "mlp_out", layer), "resid_post", layer)
    return inner.norm(h)


def by_hand(lm, request, interventions=()):
    """The request's sum of continuation logprobs, scored alone: input (ctx + cont)[:-1], last len(cont) scored."""
    ctx, cont = request
    tokens = (ctx + cont)[:-1]
    logits = np.array(lm.model.lm_head(hidden_by_hand(lm, tokens, interventions, len(ctx)))[0], dtype=np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    first = len(tokens) - len(cont)
    return float(sum(logp[first + j, t] for j, t in enumerate(cont)))


def scores(results):
    return np.array([s for s, _ in results])


class Snapshot:
    """Test hook: keeps each forward's whole hooked tensor (pads included) and its Rows."""

    def __init__(self):
        self.seen = []

    def __call__(self, x, ctx):
        self.seen.append((np.array(x), ctx.rows))
        return x


# --- each op at each positions mode ------------------------------------------------------------------


@pytest.mark.parametrize("site", [s for s in SITES if s != "attn_head"])  # attn_head (needs `head`): tests/test_steer_sites.py
@pytest.mark.parametrize("positions", ["all", "prompt", "continuation", "last"])
@pytest.mark.parametrize("op", ["add", "replace", "ablate", "clamp"])
def test_op_at_positions_equals_running_the_blocks_by_hand(lm, op, positions, site):
    steering = Steering(interventions=(iv(op, positions=positions, site=site),))
    point = f"{site}.1"
    before, after = Snapshot(), Snapshot()
    with lm.hooks.installed([(point, before)]), steered(lm, steering), lm.hooks.installed([(point, after)]):
        got = scores(loglikelihood(lm, REQUESTS, NO_REUSE))
    want = np.array([by_hand(lm, r, steering.interventions) for r in REQUESTS])
    plain = np.array([by_hand(lm, r) for r in REQUESTS])
    assert np.abs(got - want).max() < 2e-4
    assert np.abs(want - plain).max() > 1e-2  # the steering matters here
    # One padded forward: exactly the named positions of each row changed; other tokens and pads bitwise kept.
    (x0, rows), (x1, _) = before.seen[0], after.seen[0]
    assert len(before.seen) == 1 and x0.shape[0] == len(REQUESTS)
    by_length = {len(c) + len(t) - 1: (c, t) for c, t in REQUESTS}
    changed = np.abs(x1 - x0).max(axis=-1) > 0
    for b, end in enumerate(np.array(rows.ends).tolist()):
        ctx, _ = by_length[end]
        expected = np.zeros(x0.shape[1], bool)
        expected[selected(positions, len(ctx), end)] = True
        assert (changed[b] == expected).all(), (b, changed[b].astype(int))


def test_several_interventions_on_one_layer_apply_in_order(lm):
    v, w = vec(1), vec(2)

    def hooked(*ops):
        after = Snapshot()
        steering = Steering(interventions=tuple(ops))
        with steered(lm, steering), lm.hooks.installed([("resid_post.1", after)]):
            loglikelihood(lm, REQUESTS[:1], NO_REUSE)
        return after.seen[0][0][0]

    replace_v = Intervention(layer=1, op="replace", vector=tuple(map(float, v)))
    add_w = Intervention(layer=1, op="add", vector=tuple(map(float, w)))
    assert np.allclose(hooked(replace_v, add_w), v + w, atol=1e-6)  # replaced, then added to
    assert np.array_equal(hooked(add_w, replace_v), np.broadcast_to(v, (7, D)))  # the replace wins
    # Mixed ops and positions on one layer, in order, through the kernel.
    mixed = (iv("add", positions="prompt"), iv("clamp", positions="last", seed=3), iv("ablate", positions="all", seed=4))
    with steered(lm, Steering(interventions=mixed)):
        got = scores(loglikelihood(lm, REQUESTS, NO_REUSE))
    want = np.array([by_hand(lm, r, mixed) for r in REQUESTS])
    reordered = np.array([by_hand(lm, r, mixed[::-1]) for r in REQUESTS])
    assert np.abs(got - want).max() < 2e-4 and np.abs(got - reordered).max() > 1e-2


# --- batching and prefix reuse ----------------------------------------------------------------------


def shared_prefix_requests():
    rng = np.random.default_rng(5)
    shared = [1] + rng.integers(3, 700, 40).tolist()
    return [(shared + rng.integers(3, 700, 2 + i).tolist(), rng.integers(3, 700, 1 + i % 3).tolist()) for i in range(6)]


@pytest.mark.parametrize("positions", ["last", "prompt", "continuation"])
def test_prefix_reuse_and_batch_size_do_not_change_steered_numbers(lm, positions):
    reqs = shared_prefix_requests()
    steering = Steering(interventions=(iv("add", positions=positions), iv("clamp", layer=0, positions=positions, seed=1)))
    snap = Snapshot()
    with steered(lm, steering), lm.hooks.installed([("resid_post.2", snap)]):
        reused = scores(loglikelihood(lm, reqs, Batching(prefix_reuse=True)))
        plain = scores(loglikelihood(lm, reqs, NO_REUSE))
        one = scores(loglikelihood(lm, reqs, Batching(batch_size=1)))
    assert any(rows.offset >= 32 for _, rows in snap.seen)  # the family path ran: suffixes after a shared prefix
    want = np.array([by_hand(lm, r, steering.interventions) for r in reqs])
    assert np.abs(reused - want).max() < 2e-4
    assert np.abs(plain - want).max() < 2e-4 and np.abs(one - want).max() < 2e-4
    assert np.abs(want - scores(loglikelihood(lm, reqs))).max() > 1e-2


@pytest.mark.parametrize("positions", ["prompt", "continuation"])
def test_same_input_with_another_prompt_boundary_is_scored_on_its_own(lm, positions):
    tokens = [1, 17, 33, 250, 9, 71, 400, 12, 88, 5]
    a, b = (tokens[:5], tokens[5:]), (tokens[:7], tokens[7:])  # one input, (ctx + cont)[:-1], two boundaries
    steering = Steering(interventions=(iv("add", positions=positions),))
    with steered(lm, steering):
        together = scores(loglikelihood(lm, [a, b]))
        alone = np.concatenate([scores(loglikelihood(lm, [r])) for r in (a, b)])
    want = np.array([by_hand(lm, r, steering.interventions) for r in (a, b)])
    assert np.abs(together - alone).max() < 1e-5 and np.abs(together - want).max() < 2e-4


# --- generation -------------------------------------------------------------------------------------


class NoEos:
    """The model's tokenizer with no EOS id, so every row generates its max_gen_toks tokens."""

    def __init__(self, tok):
        self._tok, self.eos_token_ids = tok, set()

    def __getattr__(self, name):
        return getattr(self._tok, name)


def greedy_by_hand(lm, prompt, interventions, n):
    """Greedy tokens from full forwards of the growing sequence, steering the generated positions."""
    tokens = list(prompt)
    for _ in range(n):
        h = hidden_by_hand(lm, tokens, interventions, len(prompt))
        tokens.append(int(mx.argmax(lm.model.lm_head(h[:, -1]), axis=-1).item()))
    return tokens[len(prompt) :]


def test_steered_generation_changes_only_generated_positions(lm):
    m = dataclasses.replace(lm, tokenizer=NoEos(lm.tokenizer))
    prompts = [[1, 17, 33, 250, 9], [1, 5, 6, 7, 8, 10, 11, 13], [1, 44]]
    reqs = [GenRequest(tuple(p), max_gen_toks=5) for p in prompts]
    steering = Steering(interventions=(iv("add", layer=0, positions="continuation", alpha=8.0),))
    base = generate_tokens(m, reqs, batch_size=8)
    with steered(m, steering):
        batched = generate_tokens(m, reqs, batch_size=8)
        one = generate_tokens(m, reqs, batch_size=1)
    assert batched == one
    assert [t[0] for t in batched] == [t[0] for t in base]  # the prompt forward is not steered
    assert any(s[1:] != b[1:] for s, b in zip(batched, base))
    assert batched == [greedy_by_hand(m, p, steering.interventions, 5) for p in prompts]


# --- what steered() installs, and what it refuses ---------------------------------------------------


def test_no_steering_installs_nothing(lm):
    plain = loglikelihood(lm, REQUESTS)
    for empty in (None, Steering()):
        with steered(lm, empty):
            assert not lm.hooks.active
            assert loglikelihood(lm, REQUESTS) == plain  # bitwise


def test_steered_removes_exactly_its_hooks(lm):
    keep = Snapshot()
    with lm.hooks.installed([("resid_post.1", keep)]):
        with pytest.raises(RuntimeError, match="job failed"):
            with steered(lm, Steering(interventions=(iv(), iv(site="resid_pre", layer=-1)))):
                assert len(lm.hooks._hooks) == 2
                raise RuntimeError("job failed")
        assert lm.hooks._hooks == {"resid_post.1": [keep]}


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(layer=3), r"^interventions\[1\]\.layer: 3 is out of range for a model with 3 layers \(use 0\.\.2, or -3\.\.-1"),
        (dict(layer=-4), r"^interventions\[1\]\.layer: -4 is out of range"),
        (dict(vector=(1.0,) * 10), r"^interventions\[1\]\.vector: has 10 values but the model's hidden size is 64 \(use a vector made for this model"),
        (dict(vector=(0.0,) * D, normalize=True), r"^interventions\[1\]\.vector: all zeros: pass a nonzero vector or normalize=false$"),
        (dict(vector=(0.0,) * D, op="clamp"), r"^interventions\[1\]\.vector is all zeros, but clamp needs a direction: pass a nonzero vector$"),
    ],
)
def test_invalid_steering_is_one_line_naming_the_intervention(lm, bad, message):
    fields = {"layer": 1, "vector": tuple(map(float, vec())), **bad}
    steering = Steering(interventions=(iv(), Intervention(**fields)))
    with pytest.raises(SteeringError, match=message) as e:
        with steered(lm, steering):
            pass
    assert "\n" not in str(e.value) and not lm.hooks.active


def test_hooks_for_resolves_layers_from_the_end(lm):
    names = [n for n, _ in hooks_for(Steering(interventions=(iv(layer=-1), iv(layer=0, site="resid_pre"))), LAYERS, D)]
    assert names == ["resid_post.2", "resid_pre.0"]
    assert hidden_size(dataclasses.replace(lm, config={})) == D  # no width in the config: read off a forward


# --- the ops themselves ------------------------------------------------------------------------------


def test_ops_compute_in_the_residual_dtype_and_hit_their_targets():
    x = mx.array(np.random.default_rng(7).standard_normal((2, 3, D)).astype(np.float32))
    v = vec(8, scale=3.0)
    u = v / np.linalg.norm(v)
    ctx = HookContext("resid_post.0", 0, Rows())
    assert np.allclose(np.array(Ablate(v)(x, ctx)) @ u, 0.0, atol=1e-5)  # no component left along u
    assert np.allclose(np.array(Clamp(v, 2.5)(x, ctx)) @ u, 2.5, atol=1e-5)  # component set to alpha
    assert np.array_equal(np.array(Replace(v, 1.0)(x, ctx)), np.broadcast_to(v, x.shape))
    for op in (Add(v, 2.0), Replace(v, 0.5), Ablate(v), Clamp(v, 1.0)):
        assert op(x.astype(mx.bfloat16), ctx).dtype == mx.bfloat16
        assert op(x.astype(mx.float16), ctx).dtype == mx.float16
    with pytest.raises(SteeringError, match=r"resid_post\.0: the vector has 64 values but the residual stream has 32"):
        Add(v)(x[..., :32], ctx)


# --- notes for the head: steering that swamps the residual stream, or overflows its dtype ------------------


def _notes(lm, steering: Steering, requests=REQUESTS[:1]) -> tuple[str, ...]:
    from worker.jobs import run
    from worker.spec import Job

    return run(lm, Job(kind="loglikelihood", steering=steering), requests, NO_REUSE).notes


def _residual_norm(lm, request, point="resid_post.1") -> float:
    """Mean norm of the unsteered residual stream over one request's input tokens, read by a test hook."""
    snap = Snapshot()
    with lm.hooks.installed([(point, snap)]):
        loglikelihood(lm, [request], NO_REUSE)
    ((x, _),) = snap.seen
    return float(np.linalg.norm(x[0].astype(np.float64), axis=-1).mean())


@pytest.mark.parametrize("ratio", [1e30, 15.0])
def test_steering_that_swamps_the_residual_is_noted_with_its_ratio(lm, ratio):
    """‖α·v‖ over SWAMPED (10) times the residual's mean norm at the steered positions: one note naming the
    intervention and the ratio, as measured by hand on the unsteered stream."""
    v = vec(0)
    alpha = ratio * _residual_norm(lm, REQUESTS[0]) / float(np.linalg.norm(v.astype(np.float64)))
    notes = _notes(lm, Steering(interventions=(iv(op="add", layer=1, alpha=alpha),)))
    assert notes == (
        f"interventions[0] (add at resid_post layer 1): ‖α·v‖ is {ratio:.2g}× the residual norm there; "
        "the model no longer reads its input",
    )


def test_ordinary_steering_and_ablation_leave_no_note(lm):
    residual = _residual_norm(lm, REQUESTS[0])
    v_norm = float(np.linalg.norm(vec(0).astype(np.float64)))
    assert _notes(lm, Steering(interventions=(iv(op="add", layer=1, alpha=5 * residual / v_norm),))) == ()
    assert _notes(lm, Steering(interventions=(iv(op="ablate", layer=1), iv(op="clamp", layer=1, alpha=4.0)))) == ()
    clamp = _notes(lm, Steering(interventions=(iv(op="ablate", layer=1), iv(op="clamp", layer=-1, alpha=1e30))))
    assert len(clamp) == 1 and clamp[0].startswith("interventions[1] (clamp at resid_post layer 2): ‖α·v‖ is ")


def test_alpha_v_inf_in_the_residuals_dtype_is_noted(lm):
    """Finite in float32 (the spec's check passes) but inf in a float16 model's residual stream."""
    from worker.spec import ModelSpec

    half = load(ModelSpec(model=str(lm.path), dtype="float16"))
    steering = Steering(interventions=(iv(op="add", layer=0, alpha=1e5),))
    assert _notes(half, steering) == (
        "interventions[0] (add at resid_post layer 0): α·v is inf in float16 (the residual's dtype), "
        "so every number downstream is NaN",
    )
    assert _notes(lm, steering)[0].endswith("the model no longer reads its input")  # float32: finite, but swamping


@pytest.mark.usefixtures("ray_cluster")
def test_the_cli_warns_once_when_steering_swamps_the_stream(stories_path, tasks_dir, tmp_path):
    """alpha 1e30 (finite everywhere): every document then gets the same log-likelihoods. The warning comes
    from the workers' notes through Ray to the head, printed once however many chunks carried it."""
    from testbed.inproc import driver, session_address

    np.save(tmp_path / "v.npy", np.random.default_rng(0).standard_normal(64).astype(np.float32))
    (tmp_path / "steer.yaml").write_text("interventions:\n  - {layer: 3, vector: v.npy, alpha: 1.0e+30}\n")
    # in this process, on one worker of the session's cluster
    proc = driver("run", "--model", stories_path, "--tasks", "orchard_mc", "--include-path", tasks_dir, "--workers", "1",
                  "--address", session_address(), "--steer", "steer.yaml",
                  "--model-args", "max_batch_tokens=64", "--output-path", "out", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "no longer reads its input" in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert re.fullmatch(
        r"warning: interventions\[0\] \(add at resid_post layer 3\): ‖α·v‖ is \d\.?\d?e\+(2[89]|30)× the residual "
        r"norm there; the model no longer reads its input", warnings[0]
    ), warnings[0]
