"""Conditional steering (CAST, worker.hooks.condition) on the real TinyStories-260K model: each row of a batch of 16
mixed prompts is decided as IBM's activation-steering decides one prompt alone (re-implemented here in numpy from
its leash_layer.py), the rows that fire equal a plainly steered run of the batch and the others the unsteered run,
bitwise in float32, for loglikelihood and generation; the results say which rows fired."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from worker.generate import GenRequest
from worker.hooks import Rows
from worker.jobs import run
from worker.load import load
from worker.spec import Batching, Condition, Gate, Intervention, Job, ModelSpec, Steering, SteeringError

C_LAYER, S_LAYER, ALPHA = 2, 3, 6.0
PROMPTS = [
    "Once upon a time, there was a little girl named Lily.", "Tom had a dog.", "The sun was hot and the sky was blue.",
    "Sara saw a big cat. The cat was black and it liked milk.", "One day", "Ben went to the park with his mom and dad.",
    "The bird sang a happy song in the tree.", "Max ran fast.", "Lily and Ben played with a red ball all day long.",
    "Mom made a cake.", "It was raining outside, so Sara stayed inside and read a book.", "The fish swam.",
    "A little boy wanted a toy car for his birthday.", "The dog barked at the cat.", "Anna liked to draw.",
    "There was a big tree in the garden, and a little squirrel lived in it.",
]  # fmt: skip


@pytest.fixture(scope="module")
def lm(stories_path):
    return load(ModelSpec(model=str(stories_path)))


@pytest.fixture(scope="module")
def direction():
    return np.random.default_rng(7).standard_normal(64).astype(np.float32)


def ids(lm, text):
    return tuple(lm.tokenizer.encode(text))


def cast_rule(lm, tokens, c, layer, pool="mean"):
    """IBM's `_process_single_condition` for one prompt alone (batch 1): pool the input of `layer`, project with
    P = ger(c, c) / c.c, tanh, cosine (leash_layer.py, malleable_model.py), in numpy."""
    seen = []
    with lm.hooks.installed([(f"resid_pre.{layer}", lambda x, ctx: seen.append(x) or x)]), lm.hooks.forward(Rows()):
        mx.eval(lm.model(mx.array([tokens])))
    h = np.asarray(seen[0][0], dtype=np.float64)
    h = h.mean(axis=0) if pool == "mean" else h[-1]
    c = np.asarray(c, dtype=np.float64)
    projected = np.tanh((np.outer(c, c) / c.dot(c)) @ h)
    return float(h.dot(projected) / (np.linalg.norm(h) * np.linalg.norm(projected)))


def between(sims):
    """A threshold half-way across the widest gap near the median: half the rows above it, none close to it."""
    s = sorted(sims)
    gaps = [(s[i + 1] - s[i], i) for i in range(len(s) // 2 - 3, len(s) // 2 + 3)]
    _, i = max(gaps)
    return (s[i] + s[i + 1]) / 2


def steering(direction, condition=None):
    v = tuple(float(x) for x in np.random.default_rng(3).standard_normal(64))
    return Steering(interventions=(Intervention(layer=S_LAYER, vector=v, alpha=ALPHA, condition=condition),))


def gate(direction, threshold, compare="greater", pool="mean", layers=(C_LAYER,)):
    c = Condition(vector=tuple(map(float, direction)), layers=layers, threshold=threshold, compare=compare, pool=pool)
    return Gate(conditions=(c,))


@pytest.fixture(scope="module")
def sims(lm, direction):
    return [cast_rule(lm, ids(lm, p), direction, C_LAYER) for p in PROMPTS]


def requests(lm):
    return [(ids(lm, p), ids(lm, " The end.")) for p in PROMPTS]


def test_each_row_decided_as_cast_decides_it_alone(lm, direction, sims):
    threshold = between(sims)
    for compare in ("greater", "smaller"):
        out = run(lm, Job(kind="loglikelihood", steering=steering(direction, gate(direction, threshold, compare))),
                  requests(lm), Batching(batch_size=16))  # fmt: skip
        want = [(s > threshold) if compare == "greater" else (s < threshold) for s in sims]
        assert [r[2] for r in out] == want
        assert 4 <= sum(want) <= 12  # a mixed batch


def test_fired_rows_are_steered_bitwise_and_others_plain(lm, direction, sims):
    reqs, batching = requests(lm), Batching(batch_size=16)
    plain = run(lm, Job(kind="loglikelihood"), reqs, batching)
    steered = run(lm, Job(kind="loglikelihood", steering=steering(direction)), reqs, batching)
    cond = run(lm, Job(kind="loglikelihood", steering=steering(direction, gate(direction, between(sims)))), reqs, batching)
    assert sum(p[0] != s[0] for p, s in zip(plain, steered)) == len(reqs)  # steering changes every row
    for p, s, c in zip(plain, steered, cond):
        assert c[:2] == (list(s) if c[2] else list(p))


def test_generation_keeps_each_rows_decision(lm, direction, sims):
    reqs = [GenRequest(context=ids(lm, p), max_gen_toks=12) for p in PROMPTS]
    plain = run(lm, Job(kind="generate"), reqs, Batching(batch_size=16))
    steered = run(lm, Job(kind="generate", steering=steering(direction)), reqs, Batching(batch_size=16))
    cond = run(lm, Job(kind="generate", steering=steering(direction, gate(direction, between(sims)))), reqs, Batching(batch_size=5))
    assert sum(p != s for p, s in zip(plain, steered)) >= 8
    assert [c[1] for c in cond] == [s > between(sims) for s in sims]
    assert [c[0] for c in cond] == [s if c[1] else p for p, s, c in zip(plain, steered, cond)]


def test_conditions_combine_by_any_and_all(lm, direction, sims):
    """any/all over two conditions (one `greater`, one `smaller`, the second at the last prompt token)."""
    t, last = between(sims), [cast_rule(lm, ids(lm, p), direction, 1, pool="last") for p in PROMPTS]
    a = Condition(vector=tuple(map(float, direction)), layers=(C_LAYER,), threshold=t)
    b = Condition(vector=tuple(map(float, direction)), layers=(1,), threshold=between(last), compare="smaller", pool="last")
    for rule, join in (("any", lambda x, y: x or y), ("all", lambda x, y: x and y)):
        out = run(lm, Job(kind="loglikelihood", steering=steering(direction, Gate(conditions=(a, b), rule=rule))), requests(lm), Batching(batch_size=16))
        assert [r[2] for r in out] == [join(s > t, u < between(last)) for s, u in zip(sims, last)]


# --- through lm-eval and the command line ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_files(tmp_path_factory, direction):
    folder = tmp_path_factory.mktemp("cast")
    np.save(folder / "v.npy", np.random.default_rng(3).standard_normal(64).astype(np.float32))
    np.save(folder / "c.npy", direction)

    def spec(threshold, **condition):
        return {"interventions": [{"layer": S_LAYER, "vector": str(folder / "v.npy"), "alpha": ALPHA,
                                   "condition": {"vector": str(folder / "c.npy"), "layers": [C_LAYER], "threshold": threshold, **condition}}]}  # fmt: skip

    return folder, spec


@pytest.fixture(scope="module")
def story_tasks(tmp_path_factory):
    from testbed.stories import write_story_tasks

    return write_story_tasks(tmp_path_factory.mktemp("tasks"))


def evaluate(stories_path, tasks, steer):
    import lm_eval

    import driver  # noqa: F401  registers "mlx"

    args = {"pretrained": str(stories_path), "batch_size": 16, **({"steer": steer} if steer else {})}
    out = lm_eval.simple_evaluate(model="mlx", model_args=args, tasks=["tinystories_mc", "tinystories_ppl", "tinystories_gen"],
                                  task_manager=tasks, limit=6, log_samples=True, verbosity="ERROR")  # fmt: skip
    return {t: [s["resps"] for s in out["samples"][t]] for t in out["samples"]}


def test_lm_eval_rows_always_or_never_fired_equal_steered_or_plain(stories_path, spec_files, story_tasks):
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(story_tasks))
    folder, spec = spec_files
    plain, never, always = (evaluate(stories_path, tasks, s) for s in (None, spec(1.5), spec(-1.5)))
    steered = evaluate(stories_path, tasks, {"interventions": [{k: v for k, v in spec(0)["interventions"][0].items() if k != "condition"}]})
    assert never == plain and always == steered and steered["tinystories_ppl"] != plain["tinystories_ppl"]


@pytest.mark.usefixtures("ray_cluster")
def test_driver_run_reports_fired_rows_per_task(tmp_path, spec_files, sims, story_tasks):
    import json

    import yaml

    from testbed import inproc
    from testbed.stories import MODEL

    folder, spec = spec_files
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec(float(np.median(sims)))))
    proc = inproc.driver("run", "--model", MODEL, "--tasks", "tinystories_mc,tinystories_gen", "--include-path", story_tasks,
                         "--workers", "1", "--limit", "8", "--steer", tmp_path / "spec.yaml", "--output-path", tmp_path / "out",
                         "--address", inproc.session_address(), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    fired = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["orchard_fired"]
    assert set(fired) == {"tinystories_mc", "tinystories_gen"} and fired["tinystories_gen"]["rows"] == 8
    assert 0 < sum(f["fired"] for f in fired.values()) < sum(f["rows"] for f in fired.values())  # a mixed run
    assert "fired" in proc.stdout and f"if cos>{float(np.median(sims)):g} at L{C_LAYER}" in proc.stdout


@pytest.mark.parametrize("condition, says", [
    ({"vector": "c32.npy"}, "condition.vector: has 32 values but the model's hidden size is 64"),
    ({"vector": "nan.npy"}, "condition.vector: holds 1 NaN/inf value(s)"),
    ({"threshold": "high"}, "condition.threshold: must be a number"),
    ({"compare": "bigger"}, "condition.compare: 'bigger' is not allowed (use one of: greater, smaller)"),
    ({"pool": "max"}, "condition.pool: 'max' is not allowed (use one of: mean, last)"),
    ({"layers": [S_LAYER + 1]}, f"condition.layers: {S_LAYER + 1} comes after the steered layer {S_LAYER}"),
    ({"layers": []}, "condition.layers: is empty"),
])  # fmt: skip
def test_bad_conditions_are_refused_in_one_line_before_any_worker(tmp_path, spec_files, story_tasks, condition, says):
    import yaml

    from testbed import inproc
    from testbed.stories import MODEL

    folder, spec = spec_files
    np.save(folder / "c32.npy", np.ones(32, np.float32))
    np.save(folder / "nan.npy", np.where(np.arange(64) == 3, np.nan, 1.0).astype(np.float32))
    data = spec(0.1)
    cond = data["interventions"][0]["condition"]
    cond.update({k: (str(folder / v) if k == "vector" else v) for k, v in condition.items()})
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    proc = inproc.driver("run", "--model", MODEL, "--tasks", "tinystories_mc", "--include-path", story_tasks, "--steer", tmp_path / "spec.yaml",
                         "--output-path", tmp_path / "out", "--address", "local", cwd=tmp_path)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and says in lines[-1] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("ray_cluster")
def test_a_pipeline_group_fires_and_scores_as_a_single_worker(tmp_path, spec_files, sims, story_tasks):
    """The condition layer on rank 0, the steered layer on rank 1 (stories: layers 0-2 | 3-4): the group's results
    JSON holds the single worker's numbers and fire counts (its last rank answers, the decisions relayed to it)."""
    import json

    import yaml

    from testbed import inproc
    from testbed.stories import MODEL

    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec_files[1](float(np.median(sims)))))
    out = {}
    for name, flags in (("single", ()), ("group", ("--group-size", "2", "--split", "pipeline"))):
        proc = inproc.driver("run", "--model", MODEL, "--tasks", "tinystories_mc,tinystories_gen", "--include-path", story_tasks,
                             "--workers", "1", *flags, "--limit", "8", "--steer", tmp_path / "spec.yaml", "--output-path", tmp_path / name,
                             "--address", inproc.session_address(), cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[name] = json.loads(next((tmp_path / name).rglob("results_*.json")).read_text())
    fired = out["group"]["orchard_fired"]
    assert fired == out["single"]["orchard_fired"] and 0 < sum(f["fired"] for f in fired.values()) < sum(f["rows"] for f in fired.values())
    for task, metrics in out["single"]["results"].items():
        for key, value in metrics.items():
            if isinstance(value, float):
                assert abs(out["group"]["results"][task][key] - value) <= 1e-4, (task, key)


SHOTS = ("Once upon a time, a little cat named Tom lived in a big red house. He liked to play with a ball of yarn "
         "all day. One day the yarn rolled under the bed, and Tom looked for it everywhere.\n\n")  # fmt: skip


@pytest.mark.parametrize("pool", ["mean", "last"])
def test_a_shared_prefix_gives_what_each_whole_prompt_gives(lm, direction, pool):
    """Few-shot rows share a long prefix: run once plain and once steered, each row's suffix decided on the way up
    and reading the prefix its decision picks, equal to running every row's whole prompt, in a mixed batch."""
    reqs = [(ids(lm, SHOTS + p), ids(lm, " The end.")) for p in PROMPTS]
    assert len(ids(lm, SHOTS)) >= 40  # a family: worker.score shares prefixes of 32 tokens and more
    threshold = between([cast_rule(lm, c, direction, C_LAYER, pool) for c, _ in reqs])
    job = Job(kind="loglikelihood", steering=steering(direction, gate(direction, threshold, pool=pool)))
    whole = run(lm, job, reqs, Batching(batch_size=16, prefix_reuse=False))
    shared = run(lm, job, reqs, Batching(batch_size=16))
    steered = run(lm, Job(kind="loglikelihood", steering=steering(direction)), reqs, Batching(batch_size=16, prefix_reuse=False))
    assert 4 <= sum(w[2] for w in whole) <= 12  # a mixed batch
    assert [s[2] for s in shared] == [w[2] for w in whole]
    for w, s, st in zip(whole, shared, steered):
        assert abs(s[0] - w[0]) <= 1e-5 and s[1] == w[1]
        assert (abs(w[0] - st[0]) <= 1e-5) == w[2]  # the fired rows are the steered ones, the quiet ones are not
