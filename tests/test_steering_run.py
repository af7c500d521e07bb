"""Steered lm-eval runs: the same numbers in process and on 1 or 3 Ray workers, steering in every cache key,
an empty spec bitwise the plain model, the spec and its vectors recorded in the results, one-line errors."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from driver.cli import main
from test_cluster import MC, assert_same, evaluate, run_ray

HIDDEN, LAYERS = 64, 2  # conftest's tiny llama


def write_spec(folder, alpha: float = 3.0, interventions: str | None = None) -> str:
    """Three interventions that touch every positions mode the tasks exercise, vectors from .npy and .safetensors."""
    rng = np.random.default_rng(7)
    np.save(folder / "v.npy", rng.standard_normal(HIDDEN).astype(np.float32))
    save_file({"resid_pre.1": rng.standard_normal(HIDDEN).astype(np.float32)}, str(folder / "vectors.safetensors"))
    if interventions is None:
        interventions = f"""
  - {{layer: 1, vector: v.npy, alpha: {alpha}, positions: all}}
  - {{layer: -1, site: resid_pre, op: clamp, vector: {{file: vectors.safetensors, key: resid_pre.1}}, alpha: 0.5, positions: prompt}}
  - {{layer: 0, op: ablate, vector: v.npy, positions: last}}"""
    path = folder / f"steer-{alpha}.yaml"
    path.write_text(f"interventions:{interventions}\n")
    return str(path)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return write_spec(tmp_path_factory.mktemp("steer"))


@pytest.fixture(scope="module")
def tasks(tasks_dir):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks_dir))


@pytest.fixture(scope="module")
def steered_reference(llama_path, tasks, spec):
    from test_cluster import MODEL_ARGS

    return evaluate("mlx", {"pretrained": str(llama_path), **MODEL_ARGS, "steer": spec}, tasks)


def logprobs(results, task="orchard_mc"):
    return [x[0] for s in results["samples"][task] for (x,) in s["resps"]]


@pytest.mark.parametrize("workers", [1, 3])
def test_steered_ray_run_equals_the_in_process_run(ray_cluster, llama_path, tasks, spec, steered_reference, workers):
    ours, info = run_ray(llama_path, tasks, steer=spec, workers=workers)
    assert info["workers"] == workers
    assert_same(ours, steered_reference)


SITES_SPEC = """
  - {layer: 1, site: attn_out, vector: v.npy, alpha: 3.0, positions: all}
  - {layer: 0, site: mlp_out, op: clamp, vector: v.npy, alpha: 0.5, positions: prompt}
  - {layer: 1, site: resid_mid, op: ablate, vector: v.npy, positions: last}
  - {layer: 0, site: attn_head, head: 2, vector: h.npy, alpha: 4.0, positions: continuation}
  - {layer: 1, site: attn_head, head: 0, op: clamp, vector: h.npy, alpha: 0.3, positions: all}"""


@pytest.fixture(scope="module")
def sites_spec(tmp_path_factory):
    """Every site inside the block (issue 18): both branches, the mid-block residual, single heads."""
    folder = tmp_path_factory.mktemp("sites")
    np.save(folder / "h.npy", np.random.default_rng(8).standard_normal(HIDDEN // 4).astype(np.float32))  # head_dim 16
    return write_spec(folder, interventions=SITES_SPEC)


@pytest.fixture(scope="module")
def sites_reference(llama_path, tasks, sites_spec):
    from test_cluster import MODEL_ARGS

    return evaluate("mlx", {"pretrained": str(llama_path), **MODEL_ARGS, "steer": sites_spec}, tasks)


@pytest.mark.parametrize("workers", [1, 3])
def test_every_site_steers_alike_on_1_and_3_ray_workers(ray_cluster, llama_path, tasks, sites_spec, sites_reference, workers):
    ours, info = run_ray(llama_path, tasks, steer=sites_spec, workers=workers)
    assert info["workers"] == workers
    assert_same(ours, sites_reference)


@pytest.mark.parametrize("batch_size, prefix_reuse", [(1, True), (32, False), (32, True)])
def test_every_site_steers_alike_at_any_batching(llama_path, tasks, sites_spec, sites_reference, batch_size, prefix_reuse):
    from test_cluster import MODEL_ARGS

    plain = evaluate("mlx", {"pretrained": str(llama_path), **MODEL_ARGS}, tasks, MC)
    assert max(abs(a - b) for a, b in zip(logprobs(plain), logprobs(sites_reference))) > 1e-2  # the sites steer
    args = {**MODEL_ARGS, "batch_size": batch_size, "max_batch_tokens": 8192, "prefix_reuse": prefix_reuse}
    assert_same(evaluate("mlx", {"pretrained": str(llama_path), **args, "steer": sites_spec}, tasks), sites_reference)


def test_steering_changes_numbers_and_is_recorded(llama_path, tasks, spec, steered_reference):
    from test_cluster import MODEL_ARGS

    plain = evaluate("mlx", {"pretrained": str(llama_path), **MODEL_ARGS}, tasks, MC)
    assert max(abs(a - b) for a, b in zip(logprobs(plain), logprobs(steered_reference))) > 1e-2
    record = steered_reference["config"]["orchard"]["steering"]
    v = np.load(record["vectors"][0]["path"])
    assert record["vectors"][0]["sha256"] == hashlib.sha256(v.astype(np.float32).tobytes()).hexdigest()
    assert record["resolved_layers"] == [1, 1, 0] and len(record["key"]) == 64
    json.dumps(record)  # goes into the results JSON as is


@pytest.mark.parametrize("batch_size, prefix_reuse", [(1, True), (32, False), (32, True)])
def test_steered_numbers_do_not_depend_on_batching(llama_path, tasks, spec, steered_reference, batch_size, prefix_reuse):
    from test_cluster import MODEL_ARGS

    args = {**MODEL_ARGS, "batch_size": batch_size, "max_batch_tokens": 8192, "prefix_reuse": prefix_reuse}
    ours = evaluate("mlx", {"pretrained": str(llama_path), **args, "steer": spec}, tasks)
    assert_same(ours, steered_reference)


def test_an_empty_spec_is_bitwise_the_plain_model(llama_path, tasks, tmp_path):
    from test_cluster import MODEL_ARGS

    empty = tmp_path / "empty.yaml"
    empty.write_text("interventions: []\n")
    plain = evaluate("mlx", {"pretrained": str(llama_path), **MODEL_ARGS}, tasks, MC)
    ours = evaluate("mlx", {"pretrained": str(llama_path), **MODEL_ARGS, "steer": str(empty)}, tasks, MC)
    assert logprobs(ours) == logprobs(plain)  # exactly


def test_the_cache_keys_steering(ray_cluster, llama_path, tasks, tmp_path):
    """Same spec: served from the cache. Another alpha: computed. Unsteered and steered never mixed."""
    specs = {alpha: write_spec(tmp_path, alpha) for alpha in (3.0, 2.0)}
    cache = str(tmp_path / "cache")

    def go(**steer):
        ours, info = run_ray(llama_path, tasks, MC, workers=2, cache=cache, **steer)
        return logprobs(ours), sum(info["requests_computed"].values()), info["requests_cached"]

    first, computed, cached = go(steer=specs[3.0])
    assert (computed, cached) == (48, 0)
    again, computed, cached = go(steer=specs[3.0])
    assert (computed, cached) == (0, 48) and again == first
    other, computed, cached = go(steer=specs[2.0])
    assert (computed, cached) == (48, 0) and other != first
    plain, computed, cached = go()
    assert (computed, cached) == (48, 0) and plain != first and plain != other


@pytest.mark.parametrize(
    "interventions, message",
    [
        ("\n  - {layer: 5, vector: v.npy}", "interventions[0].layer: 5 is out of range for a model with 2 layers"),
        ("\n  - {layer: 1, vector: w.npy}", "w.npy"),
        ("\n  - {layer: 1, vector: v.pt}", "pickle"),
        ("\n  - {layer: 1, vector: v.npy, op: shift}", "interventions[0].op"),
        ("\n  - {layer: 1, vector: v.npy, alpha: lots}", "interventions[0].alpha"),
    ],
)
def test_cli_refuses_a_bad_spec_in_one_line_and_writes_nothing(llama_path, tasks_dir, tmp_path, interventions, message):
    spec = write_spec(tmp_path, interventions=interventions)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        ["run", "--model", str(llama_path), "--tasks", "orchard_mc", "--include-path", str(tasks_dir), "--workers", "1",
         "--output-path", str(out), "--steer", spec],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], result.output
    assert "Traceback" not in result.output and not out.exists()


# --- driver vectors -----------------------------------------------------------------------------------

PAIRS = [
    ("The little dog was", " happy and played all day.", " sad and cried all day."),
    ("Once upon a time a girl felt", " happy.", " sad."),
    ("The king said he was", " glad to see his friend.", " angry to see his friend."),
    ("At night the cat was", " happy in the warm house.", " sad in the cold house."),
    ("", "I love this happy day.", "I hate this sad day."),
    ("The boy saw the tree and was", " happy.", " sad."),
]


def write_pairs(path) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "positive": a, "negative": b}) + "\n" for p, a, b in PAIRS))
    return str(path)


def vectors_cli(*args):
    return CliRunner().invoke(main, ["vectors", *map(str, args)])


def test_vectors_on_1_and_3_workers_are_identical_and_steer_a_run(ray_cluster, llama_path, tasks, tmp_path):
    from safetensors import safe_open

    from driver.steering.spec import load_steering
    from test_cluster import MODEL_ARGS

    pairs = write_pairs(tmp_path / "pairs.jsonl")
    found = {}
    for workers in (1, 3):
        out = tmp_path / f"v{workers}.safetensors"
        result = vectors_cli("--model", llama_path, "--pairs", pairs, "--layers", "all", "--workers", workers, "--out", out)
        assert result.exit_code == 0, result.output
        with safe_open(str(out), "numpy") as f:
            found[workers] = ({k: f.get_tensor(k) for k in f.keys()}, f.metadata())
    (one, meta), (three, _) = found[1], found[3]
    assert sorted(one) == ["resid_post.0", "resid_post.1"]
    assert all(np.abs(one[k] - three[k]).max() <= 1e-6 for k in one)
    assert meta["method"] == "mean-diff" and meta["n_pairs"] == "6" and meta["site"] == "resid_post"
    assert meta["pairs_file_sha256"] == hashlib.sha256(open(pairs, "rb").read()).hexdigest()
    spec = tmp_path / "steer.yaml"  # the file is a vector source as written: key defaults to resid_post.1
    spec.write_text("interventions:\n  - {layer: 1, vector: {file: v3.safetensors}, alpha: 4.0}\n")
    assert np.array_equal(load_steering(str(spec)).steering.interventions[0].array(), three["resid_post.1"])
    plain = evaluate("mlx", {"pretrained": str(llama_path), **MODEL_ARGS}, tasks, MC)
    steered = evaluate("mlx", {"pretrained": str(llama_path), **MODEL_ARGS, "steer": str(spec)}, tasks, MC)
    assert logprobs(plain) != logprobs(steered)


@pytest.mark.parametrize(
    "pairs, layers, message, code",
    [  # a bad file it names: 1; a bad flag value: 2 (usage)
        ("", "all", "empty", 1),
        ('{"positive": "a"}\n', "all", "line 1", 1),
        ('{"positive": "a", "negative": "b"}\nnot json\n', "all", "line 2", 1),
        ('{"positive": "a", "negative": "b"}\n', "7", "--layers 7", 2),
    ],
)
def test_vectors_bad_input_is_one_line_and_writes_nothing(llama_path, tmp_path, pairs, layers, message, code):
    path = tmp_path / "pairs.jsonl"
    path.write_text(pairs)
    out = tmp_path / "v.safetensors"
    result = vectors_cli("--model", llama_path, "--pairs", path, "--layers", layers, "--workers", 1, "--out", out)
    assert result.exit_code == code, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], result.output
    assert not out.exists()
