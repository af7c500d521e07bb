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
