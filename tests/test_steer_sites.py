"""The branch sites `attn_out` and `mlp_out` against lm-eval's own `steered` model (transformers + torch) on the
same weights: Orchard's add and clamp there are lm-eval's add and clamp at `layers.L.self_attn` / `layers.L.mlp`
(the module's output, its first element when it returns a tuple), on loglikelihood, rolling and greedy tasks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

import lm_eval  # noqa: E402
import numpy as np  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import driver  # noqa: E402,F401  registers "mlx"

TASKS = ["orchard_mc", "orchard_ppl", "orchard_gen"]
MAX_LENGTH, LAYER, ALPHA = 64, 1, 4.0
HF_MODULE = {"attn_out": "self_attn", "mlp_out": "mlp"}  # HF's module names in llama; gpt2: attn, mlp
HF_LAYERS = {"llama": "layers", "gpt2": "h"}


@pytest.fixture(scope="module")
def manager(tasks_dir):
    return TaskManager(include_path=str(tasks_dir))


def evaluate(model, model_args, manager):
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=TASKS, task_manager=manager, log_samples=True,
        device="cpu", batch_size=4, verbosity="ERROR",
    )  # fmt: skip


def responses(results, task):
    return [x for s in results["samples"][task] for (x,) in s["resps"]]


@pytest.fixture(scope="module")
def unsteered(model_path, manager):
    return evaluate("mlx", {"pretrained": str(model_path), "max_length": MAX_LENGTH}, manager)


def hidden(model_path) -> int:
    import json

    config = json.loads((model_path / "config.json").read_text())
    return config.get("hidden_size") or config["n_embd"]


@pytest.mark.parametrize("op", ["add", "clamp"])
@pytest.mark.parametrize("site", ["attn_out", "mlp_out"])
def test_branch_sites_match_lm_evals_steered_model(model_path, manager, unsteered, tmp_path, site, op):
    arch = "gpt2" if "gpt2" in model_path.name else "llama"
    v = np.random.default_rng(5).standard_normal(hidden(model_path)).astype(np.float32)
    # steered clamps along a unit direction to `steering_coefficient`; Orchard's clamp normalises v itself.
    ref_vector = v / np.linalg.norm(v) if op == "clamp" else v
    np.save(tmp_path / "v.npy", v)
    spec = tmp_path / "steer.yaml"
    spec.write_text(f"interventions:\n  - {{layer: {LAYER}, site: {site}, op: {op}, vector: v.npy, alpha: {ALPHA}}}\n")
    module = HF_MODULE[site] if arch == "llama" or site == "mlp_out" else "attn"
    hookpoint = f"{HF_LAYERS[arch]}.{LAYER}.{module}"
    steer_pt = tmp_path / "steer.pt"
    torch.save({hookpoint: {"steering_vector": torch.tensor(ref_vector), "steering_coefficient": ALPHA, "action": op}}, steer_pt)

    ours = evaluate("mlx", {"pretrained": str(model_path), "max_length": MAX_LENGTH, "steer": str(spec)}, manager)
    theirs = evaluate(
        "steered", {"pretrained": str(model_path), "steer_path": str(steer_pt), "dtype": "float32", "max_length": MAX_LENGTH}, manager
    )
    mc = list(zip(responses(ours, "orchard_mc"), responses(theirs, "orchard_mc")))
    assert max(abs(x[0] - y[0]) for x, y in mc) <= 1e-4 and all(x[1] == y[1] for x, y in mc)
    ppl = list(zip(responses(ours, "orchard_ppl"), responses(theirs, "orchard_ppl")))
    assert all(abs(x - y) <= 1e-4 + 1e-6 * abs(y) for x, y in ppl), ppl
    assert responses(ours, "orchard_gen") == responses(theirs, "orchard_gen")
    # The steering did something: loglikelihoods move well past the tolerance.
    plain = responses(unsteered, "orchard_mc")
    assert max(abs(x[0] - p[0]) for (x, _), p in zip(mc, plain)) > 1e-2


# --- attn_head: one head's output before the output projection ----------------------------------------------
# Per head, checked with no second model: an `add` of v at attn_head.L head h is an `add` of W_O[:, h*d:(h+1)*d] @ v at
# attn_out.L (families without a post-attention norm), and ablate / clamp against a hand-written torch hook that
# wraps the plain model's output projection and edits its input reshaped to [B, S, H, d].

HEAD_FAMILIES = ["llama", "qwen2", "gpt2", "phi3", "mixtral"]
HEAD, HEAD_LAYER = 2, 1
TOKENS = [[1, 17, 33, 250, 9, 71, 400, 12], [5, 6, 7, 8, 9, 10, 0, 0]]
SHARED = tuple(range(100, 140))  # 40 tokens: past worker.score.MIN_SHARED_PREFIX, so prefix reuse has work to do
LL_REQUESTS = [((1, 17, 33, 250), (9, 71)), ((1, 17, 33, 250), (400, 12, 5)), ((5, 6, 7), (8,)), ((2, 3, 4, 5, 6, 7, 8), (9, 10)),
               (SHARED, (9, 71)), (SHARED, (400, 12, 5)), (SHARED + (3,), (4,))]  # fmt: skip


@pytest.fixture(scope="module", params=HEAD_FAMILIES + ["stories"])
def head_lm(request, tmp_path_factory, stories_path):
    from testbed.models import write_model
    from worker.load import load

    if request.param == "stories":
        return load(str(stories_path))
    kv = 4 if request.param == "gpt2" else 2
    return load(str(write_model(tmp_path_factory.mktemp(request.param), arch=request.param, heads=4, kv_heads=kv)))


def projection(lm, layer: int):
    """The plain (unhooked) family-specific path to block `layer`'s attention output projection."""
    from worker.hooks import decoder_layers

    block = decoder_layers(lm.model)[layer]
    return block.self_attn.o_proj if hasattr(block, "self_attn") else block.attn.c_proj


def head_spec(layer, vector, **fields):
    from worker.spec import Intervention, Steering

    return Steering(interventions=(Intervention(layer=layer, vector=tuple(np.asarray(vector).tolist()), **fields),))


def run_all(lm, steering, batching=None, prefix_reuse=True):
    from worker.generate import GenRequest, generate_tokens
    from worker.score import loglikelihood
    from worker.steer import steered

    contexts = [tuple(t for t in row if t) for row in TOKENS] + [SHARED + (5,), SHARED + (6, 7)]
    requests = [GenRequest(context=c, max_gen_toks=6) for c in contexts]
    with steered(lm, steering):
        ll = loglikelihood(lm, LL_REQUESTS, batching)
        gen = generate_tokens(lm, requests, batch_size=2, prefix_reuse=prefix_reuse)
    return np.array([x for x, _ in ll]), gen


def test_head_add_is_the_projected_add_at_attn_out(head_lm):
    from worker.spec import head_shape

    heads, d = head_shape(head_lm.config)
    v = np.random.default_rng(7).standard_normal(d).astype(np.float32) * 2.0
    w = np.array(projection(head_lm, HEAD_LAYER).weight)[:, HEAD * d:(HEAD + 1) * d] @ v
    at_head = run_all(head_lm, head_spec(HEAD_LAYER, v, site="attn_head", head=HEAD, alpha=ALPHA))
    at_out = run_all(head_lm, head_spec(HEAD_LAYER, w, site="attn_out", alpha=ALPHA))
    plain = run_all(head_lm, None)
    np.testing.assert_allclose(at_head[0], at_out[0], atol=1e-4)
    assert at_head[1] == at_out[1]
    assert np.abs(at_head[0] - plain[0]).max() > 1e-2  # it steered


def hand_hook(lm, layer: int, edit):
    """Wrap block `layer`'s output projection (the instrumented model's hooks stay idle): its input goes through
    `edit` as a torch [B, S, H, d] tensor."""
    from worker.spec import head_shape

    heads, d = head_shape(lm.config)
    block_attn = projection(lm, layer)
    original = type(block_attn).__mro__[1] if getattr(block_attn, "_orchard_projection", False) else type(block_attn)

    def call(x):
        t = torch.tensor(np.array(x)).reshape(*x.shape[:2], heads, d)
        edited = edit(t).reshape(*x.shape[:2], heads * d).numpy()
        return original.__call__(block_attn, mx_array(edited))

    return call


def mx_array(a):
    import mlx.core as mx

    return mx.array(a)


@pytest.mark.parametrize("op", ["ablate", "clamp", "replace"])
def test_head_ops_match_a_hand_written_torch_hook_on_the_projection_input(head_lm, op, monkeypatch):
    from worker.spec import head_shape

    heads, d = head_shape(head_lm.config)
    v = np.random.default_rng(3).standard_normal(d).astype(np.float32)
    u = torch.tensor(v / np.linalg.norm(v))

    def edit(z):  # z: [B, S, H, d]; only head HEAD changes
        z = z.clone()
        zh = z[:, :, HEAD]
        if op == "ablate":
            z[:, :, HEAD] = zh - (zh @ u)[..., None] * u
        elif op == "clamp":
            z[:, :, HEAD] = zh + (ALPHA - zh @ u)[..., None] * u
        else:
            z[:, :, HEAD] = zh + 0.5 * (torch.tensor(v) - zh)
        return z

    alpha = 0.5 if op == "replace" else ALPHA
    ours = run_all(head_lm, head_spec(HEAD_LAYER, v, site="attn_head", head=HEAD, op=op, alpha=alpha))
    proj = projection(head_lm, HEAD_LAYER)
    call = hand_hook(head_lm, HEAD_LAYER, edit)
    cls = type(proj)
    monkeypatch.setattr(cls, "__call__", lambda self, x, *a, **k: call(x) if self is proj else cls.__mro__[1].__call__(self, x, *a, **k))
    theirs = run_all(head_lm, None)
    monkeypatch.undo()
    np.testing.assert_allclose(ours[0], theirs[0], atol=1e-4)
    assert ours[1] == theirs[1]
    assert np.abs(ours[0] - run_all(head_lm, None)[0]).max() > 1e-3


def test_head_capture_is_the_projection_inputs_slice(head_lm, monkeypatch):
    from worker.capture import capture
    from worker.spec import Batching

    seen = []
    proj = projection(head_lm, HEAD_LAYER)
    base = type(proj).__mro__[1]  # the plain Linear under the hooked class: it sees the input after the hooks
    original = base.__call__
    monkeypatch.setattr(base, "__call__", lambda self, x, *a, **k: (seen.append(np.array(x)) if self is proj else None) or original(self, x, *a, **k))
    requests = [((1, 17, 33, 250, 9), -1), ((5, 6, 7), 1), ((2, 3, 4, 5, 6, 7, 8), 3)]
    got = capture(head_lm, requests, [f"attn_head.{HEAD_LAYER}"], Batching(batch_size=1))
    monkeypatch.undo()
    by_length = {x.shape[1]: x for x in seen}  # batch_size 1: one forward per request, shortest first
    for (tokens, position), a in zip(requests, got):
        assert np.array_equal(a[0], by_length[len(tokens)][0, position])


def test_head_steering_does_not_depend_on_batch_size_or_prefix_reuse(head_lm):
    from worker.spec import Batching, head_shape

    heads, d = head_shape(head_lm.config)
    v = np.random.default_rng(11).standard_normal(d).astype(np.float32)
    for op in ("add", "clamp"):
        spec = head_spec(HEAD_LAYER, v, site="attn_head", head=heads - 1, op=op, alpha=ALPHA, positions="continuation")
        one = run_all(head_lm, spec, Batching(batch_size=1, prefix_reuse=False), prefix_reuse=False)
        many = run_all(head_lm, spec, Batching(batch_size=32, prefix_reuse=True), prefix_reuse=True)
        assert np.abs(one[0] - many[0]).max() <= 1e-5 and one[1] == many[1]


def test_attn_head_installed_but_idle_is_an_error_and_nothing_installed_is_bitwise_plain(head_lm):
    import mlx.core as mx
    from mlx_lm.utils import load as mlx_load

    from worker.hooks import HookError

    x = mx.array([TOKENS[0]])
    plain, _ = mlx_load(str(head_lm.path))
    assert mx.array_equal(plain(x), head_lm.model(x)).item()
    from worker.hooks import Rows

    with pytest.raises(HookError, match=f"hook attn_head.{HEAD_LAYER} never ran"):
        with head_lm.hooks.installed([(f"attn_head.{HEAD_LAYER}", lambda y, ctx: y)]), head_lm.hooks.forward(Rows()):
            pass  # a kernel forward in which block HEAD_LAYER's output projection never ran
    ran = []
    with head_lm.hooks.installed([(f"attn_head.{HEAD_LAYER}", lambda y, ctx: ran.append(y.shape) or y)]), head_lm.hooks.forward(Rows()):
        head_lm.model(x)
    assert ran and ran[0][:2] == (1, len(TOKENS[0]))


def test_a_grid_over_heads_equals_each_head_steered_alone(head_lm):
    """worker.grid (sweeps) runs attn_head configurations as plain steered runs do, request by request."""
    from worker.grid import grid_loglikelihood
    from worker.score import loglikelihood
    from worker.spec import Batching, head_shape
    from worker.steer import steered

    heads, d = head_shape(head_lm.config)
    v = np.random.default_rng(5).standard_normal(d).astype(np.float32)
    configs = [head_spec(HEAD_LAYER, v, site="attn_head", head=h, alpha=ALPHA) for h in (0, heads - 1)]
    grid = grid_loglikelihood(head_lm, configs, LL_REQUESTS, Batching(batch_size=4))
    for j, steering in enumerate(configs):
        with steered(head_lm, steering):
            alone = loglikelihood(head_lm, LL_REQUESTS, Batching(batch_size=4))
        assert max(abs(row[j][0] - a[0]) for row, a in zip(grid, alone)) <= 1e-5
    assert max(abs(row[0][0] - row[1][0]) for row in grid) > 1e-3  # two heads, two different results


def test_attn_head_across_a_pipeline_equals_unsplit_and_a_tensor_split_refuses_it(stories_path):
    """A real 2-process mx.distributed ring (127.0.0.1): pipeline ranks own stories' layers 0-2 | 3-4, so head
    steering and capture at layers 1 and 3 each run on one rank only; a tensor split refuses attn_head in one line."""
    from testbed.ring import run_split
    from worker.jobs import run
    from worker.load import load
    from worker.spec import Batching, Grouping, Job

    v = np.random.default_rng(2).standard_normal(8).astype(np.float32)
    ll = [((1, 5, 9, 20, 30), (40, 41)), ((1, 7, 8), (9,))]
    work = [(f"steer_{layer}", Job(kind="loglikelihood", steering=head_spec(layer, v, site="attn_head", head=5, alpha=ALPHA)), ll)
            for layer in (1, 3)]  # fmt: skip
    work.append(("capture", Job(kind="capture", points=("attn_head.1", "attn_head.3")), [((1, 5, 9, 20), -1), ((1, 7, 8), 1)]))
    lm = load(str(stories_path))
    want = [list(run(lm, job, requests, Batching())) for _, job, requests in work]
    plain = [lp for lp, _ in run(lm, Job(kind="loglikelihood"), ll, Batching())]
    reports = run_split({"stories": stories_path}, Grouping(size=2, split="pipeline"), [("stories", j, r) for _, j, r in work])
    for (label, _, _), got, expected in zip(work, reports[-1]["results"], want):  # the last rank answers
        assert not isinstance(got, str), got
        if label == "capture":
            assert all(np.abs(g - w).max() <= 1e-5 for g, w in zip(got, expected, strict=True))
        else:
            assert np.abs(np.array([g[0] for g in got]) - [e[0] for e in expected]).max() <= 1e-5
    assert all(abs(e[0] - p) > 1e-3 for e, p in zip(want[1], plain))  # layer 3 (rank 1's) steered
    tensor = run_split({"stories": stories_path}, Grouping(size=2, split="tensor"), [("stories", work[0][1], ll)])
    assert all("use --split pipeline" in report["results"][0] for report in tensor), tensor[0]["results"]


HEAD_REQUESTS = [((1, 17, 33, 250), (9, 71)), ((5, 6, 7), (8,)), ((2, 3, 4, 5, 6, 7, 8), (9, 10, 11))]  # 5, 3, 9 inputs


def head_op_by_hand(op: str, z: np.ndarray, v: np.ndarray, alpha: float) -> np.ndarray:
    """One head's [.., d] values after `op`, in float64 numpy."""
    u = v / np.linalg.norm(v)
    return {"add": lambda: z + alpha * v, "replace": lambda: z + alpha * (v - z), "ablate": lambda: z - (z @ u)[..., None] * u,
            "clamp": lambda: z + (alpha - z @ u)[..., None] * u}[op]()  # fmt: skip


@pytest.mark.parametrize("positions", ["all", "prompt", "continuation", "last"])
@pytest.mark.parametrize("op", ["add", "replace", "ablate", "clamp"])
def test_each_op_at_each_positions_rule_edits_exactly_that_heads_columns_there(llama_path, op, positions):
    """One padded forward, seen at attn_head.1 before and after the steering: at the positions the rule names in
    each row, head 2's columns are the op applied by hand; every other column, position and pad is bitwise kept."""
    from worker.load import load
    from worker.score import loglikelihood
    from worker.spec import Batching
    from worker.steer import steered

    lm = load(str(llama_path))
    seen: dict[str, list] = {"before": [], "after": []}
    snap = {k: (lambda x, ctx, k=k: seen[k].append((np.array(x), ctx.rows)) or x) for k in seen}
    v = np.random.default_rng(4).standard_normal(16).astype(np.float32)
    alpha = 0.5 if op == "replace" else ALPHA
    steering = head_spec(1, v, site="attn_head", head=2, op=op, alpha=alpha, positions=positions)
    point = "attn_head.1"
    with lm.hooks.installed([(point, snap["before"])]), steered(lm, steering), lm.hooks.installed([(point, snap["after"])]):
        loglikelihood(lm, HEAD_REQUESTS, Batching(prefix_reuse=False))
    (x0, rows), (x1, _) = seen["before"][0], seen["after"][0]
    assert len(seen["before"]) == 1 and x0.shape[0] == len(HEAD_REQUESTS)
    by_length = {len(c) + len(t) - 1: len(c) for c, t in HEAD_REQUESTS}
    expected = x0.astype(np.float64)
    for b, end in enumerate(np.array(rows.ends).tolist()):
        n_ctx = by_length[end]
        span = {"all": (0, end), "prompt": (0, n_ctx), "continuation": (n_ctx, end), "last": (end - 1, end)}[positions]
        expected[b, span[0]:span[1], 32:48] = head_op_by_hand(op, expected[b, span[0]:span[1], 32:48], v.astype(np.float64), alpha)
    np.testing.assert_allclose(x1, expected, atol=1e-5)
    untouched = np.ones(x0.shape, bool)
    untouched[..., 32:48] = False
    assert np.array_equal(x1[untouched], x0[untouched])  # other heads bitwise kept
    assert np.abs(x1 - x0).max() > 1e-3


def test_mlx_ray_refuses_attn_head_on_a_tensor_split_before_ray_starts(stories_path, tmp_path):
    """lm-eval's `mlx-ray` with model_args group_size=2,split=tensor refuses head steering as `driver run` does,
    while the model is set up: before Ray starts or any worker loads."""
    import ray

    from driver.checks.errors import BadUsage
    from driver.lm.mlx_ray import MLXRayLM

    np.save(tmp_path / "h.npy", np.ones(8, np.float32))  # stories: 8 heads of 8
    spec = {"interventions": [{"layer": 1, "site": "attn_head", "head": 0, "vector": str(tmp_path / "h.npy")}]}
    started = ray.is_initialized()
    with pytest.raises(BadUsage, match=r"^attn_head steering on a tensor-split group: .*use --split pipeline$"):
        MLXRayLM(pretrained=str(stories_path), steer=spec, group_size=2, split="tensor", address="local")
    assert ray.is_initialized() == started
