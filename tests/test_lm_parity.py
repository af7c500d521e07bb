"""The `mlx` lm-eval model against lm-eval's own `hf` backend (transformers + torch) on the same weights."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import driver  # noqa: E402,F401  registers "mlx"

TASKS = ["orchard_mc", "orchard_ppl", "orchard_gen"]
MAX_LENGTH = 64  # small, so rolling windows and truncation are exercised


@pytest.fixture(scope="module")
def manager(tasks_dir, tmp_path_factory):
    """One task index for the module (lm-eval takes seconds to build one): the fixture tasks and the long ones."""
    from parity_tasks import write_long_tasks

    long = write_long_tasks(tmp_path_factory.mktemp("long-tasks"), tasks_dir)
    return TaskManager(include_path=[str(tasks_dir), str(long)])


def evaluate(model, path, manager, batch_size=4, **extra):
    args = f"pretrained={path},max_length={MAX_LENGTH}" + "".join(f",{k}={v}" for k, v in extra.items())
    return lm_eval.simple_evaluate(
        model=model,
        model_args=args,
        tasks=TASKS,
        task_manager=manager,
        log_samples=True,
        device="cpu",
        batch_size=batch_size,
        verbosity="ERROR",
    )


@pytest.fixture(scope="module")
def hf_results(model_path, manager):
    return evaluate("hf", model_path, manager, dtype="float32")


def close(a: float, b: float) -> bool:
    """1e-4 per request; long rolling documents sum hundreds of float32 logprobs, so allow 1e-6 relative."""
    return abs(a - b) <= 1e-4 + 1e-6 * abs(b)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_simple_evaluate_matches_hf_backend(model_path, manager, hf_results, batch_size):
    ours = evaluate("mlx", model_path, manager, batch_size=batch_size)
    for task in TASKS:
        mine, ref = ours["samples"][task], hf_results["samples"][task]
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in ref]
        for a, b in zip(mine, ref):
            for x, y in zip(a["resps"], b["resps"]):
                x, y = x[0], y[0]
                if task == "orchard_mc":
                    assert close(x[0], y[0]) and x[1] == y[1], (x, y)
                elif task == "orchard_ppl":
                    assert close(x, y), (x, y)
                else:
                    assert x == y, (x, y)
        for metric, value in hf_results["results"][task].items():
            if metric.endswith("perplexity,none") or metric.startswith("bits_per_byte,"):
                assert ours["results"][task][metric] == pytest.approx(value, rel=1e-5)
            elif isinstance(value, float):
                assert ours["results"][task][metric] == pytest.approx(value, abs=1e-12), metric
    assert ours["config"]["orchard"]["files"]  # model identity recorded with the results


def test_prefix_families_stop_strings_and_truncation_match_hf_backend(model_path, manager):
    """The model's own 512-token window: few-shot prefixes run once per family (KV reuse), generations stop at
    a stop string or run to max_gen_toks, and every number and text is still the hf backend's."""
    from parity_tasks import LONG_TASKS, coverage

    from driver.lm.mlx import MLXLM
    from cluster.schedule import gather
    from worker.score import families

    common = dict(tasks=LONG_TASKS, task_manager=manager, log_samples=True, verbosity="ERROR")
    ref = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_path},dtype=float32", batch_size=4, device="cpu", **common)
    ours_lm = MLXLM(pretrained=str(model_path), batch_size=8)
    seen: list = []
    run = ours_lm.executor.run

    def recording(job, requests, total=None):
        requests = gather(requests, total)
        seen.append((job.kind, requests))
        return run(job, requests)

    ours_lm.executor.run = recording
    ours = lm_eval.simple_evaluate(model=ours_lm, **common)
    for task in LONG_TASKS:
        mine, theirs = ours["samples"][task], ref["samples"][task]
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in theirs]
        for a, b in zip(mine, theirs):
            for (x,), (y,) in zip(a["resps"], b["resps"]):
                if task == "orchard_mc_shared":
                    assert close(x[0], y[0]) and x[1] == y[1], (x, y)
                else:
                    assert x == y, (x, y)
    # What the run reached: prefix families (a group wider than one input's 4 answers) ...
    (ll,) = [r for kind, r in seen if kind == "loglikelihood"]
    assert max(len(ctx) for ctx, _ in ll) > 100
    assert max(map(len, families(ll, ours_lm.max_length))) >= 8
    # ... and generations cut by a stop string and, for the llama, by max_gen_toks (the tiny gpt2 writes ":"
    # forever, so "::::" stops every one of its answers).
    prompts = [s["arguments"][0][0] for s in ours["samples"]["orchard_gen_stops"]]
    reached = coverage(ours_lm.executor.lm, prompts, ours_lm.tok_encode)
    assert reached["stop"] > 0 and (reached["max"] > 0 or model_path.name == "tiny-gpt2"), reached


EDGE_CASES = [
    ("", " the river"),  # empty context: the prefix token conditions
    ("Question: what is water?\nAnswer:", "   three leading spaces"),
    ("Answer: ", "trailing space moves to the continuation"),
    (" ".join(["king queen river mountain"] * 40), " tree"),  # context longer than the window
    ("Café in 日本 — naïve?", " 😀 ß"),  # non-ASCII on both sides
]


def test_edge_case_requests_match_hf_backend(llama_path):
    from lm_eval.models.huggingface import HFLM

    from driver.lm.mlx import MLXLM

    hf = HFLM(pretrained=str(llama_path), max_length=MAX_LENGTH, dtype="float32", batch_size=4, device="cpu")
    ours = MLXLM(pretrained=str(llama_path), max_length=MAX_LENGTH, batch_size=3)
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(EDGE_CASES)]
    for (a, ga), (b, gb) in zip(ours.loglikelihood(requests), hf.loglikelihood(requests)):
        assert close(a, b) and ga == gb
    rolling = [Instance("loglikelihood_rolling", {}, (text,), i) for i, (text, _) in enumerate(EDGE_CASES)]
    for a, b in zip(ours.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling)):
        assert close(a, b)


def test_importing_orchard_keeps_lm_eval_backends():
    from lm_eval.api.registry import get_model

    from driver.lm.mlx import MLXLM

    assert get_model("mlx") is MLXLM
    assert get_model("hf").__name__ == "HFLM"
    assert get_model("dummy").__name__ == "DummyLM"


def test_real_mmlu_on_a_real_pretrained_model_matches_hf_backend(stories_path, offline_mmlu, manager):
    """lm-eval's stock mmlu subtask (offline cache) on the real TinyStories Llama, both backends."""
    common = dict(
        tasks=["mmlu_abstract_algebra"], num_fewshot=2, limit=6, log_samples=True, verbosity="ERROR", device="cpu",
        task_manager=manager,  # lm-eval's own tasks are in every index
    )  # fmt: skip
    ours = lm_eval.simple_evaluate(model="mlx", model_args=f"pretrained={stories_path}", batch_size=8, **common)
    ref = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={stories_path},dtype=float32", batch_size=8, **common)
    task = "mmlu_abstract_algebra"
    for a, b in zip(ours["samples"][task], ref["samples"][task]):
        for (x,), (y,) in zip(a["resps"], b["resps"]):
            assert close(x[0], y[0]) and x[1] == y[1], (x, y)
    assert ours["results"][task]["acc,none"] == ref["results"][task]["acc,none"]
