"""`driver sweep`: a layer × alpha grid on lm-eval tasks and a prompt set, on 1 and 3 real Ray workers (same
table), a configuration equal to an independent steered run, the outputs' shape, resume after a real
interrupted process, and bad sweep files refused in one line before any worker starts."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from driver.sweep import outdir, plots, report, summary
from driver.cli import main
from testbed.inproc import session_address
from testbed.waiting import until

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = 64  # conftest's tiny llama: 2 layers, hidden 64
PROMPTS = [
    ("The little dog was", " happy", " sad"),
    ("Once upon a time a girl felt", " happy", " sad"),
    ("The king said he was", " glad", " angry"),
    ("At night the cat was", " happy", " sad"),
]
TASK_METRICS = 5  # orchard_mc acc; orchard_ppl word_perplexity, byte_perplexity, bits_per_byte; orchard_gen exact_match
PROMPT_METRICS = 6  # logprob_positive, logprob_negative, logprob_diff, p_positive; fluency_logprob, repetition_rate


def write_study(folder: Path, llama_path, tasks_dir, *, tasks: bool = True, alphas=(-2.0, 2.0), max_gen_toks: int = 6,
                extra: str = "", prompts: str | None = None) -> Path:  # fmt: skip
    """A sweep file (and its vectors and prompt set) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    save_file({f"resid_post.{i}": rng.standard_normal(HIDDEN).astype(np.float32) for i in range(2)}, str(folder / "v.safetensors"))
    if prompts is None:
        prompts = "".join(json.dumps({"prompt": p, "targets": {"positive": a, "negative": b}}) + "\n" for p, a, b in PROMPTS)
    (folder / "prompts.jsonl").write_text(prompts)
    task_block = f"""
tasks:
  names: [orchard_mc, orchard_ppl, orchard_gen]
  limit: 4
  include_path: {tasks_dir}""" if tasks else ""  # fmt: skip
    (folder / "sweep.yaml").write_text(
        f"""model: {{pretrained: {llama_path}, max_length: 64, batch_size: 4, max_batch_tokens: 128}}
vectors:
  v: {{file: v.safetensors, normalize: true}}
grid:
  layers: all
  alphas: {list(alphas)}
prompts:
  - {{file: prompts.jsonl, max_gen_toks: {max_gen_toks}}}{task_block}
{extra}"""
    )
    return folder / "sweep.yaml"


def sweep_cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["sweep", *map(str, args)])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def study(tmp_path_factory, llama_path, tasks_dir):
    return write_study(tmp_path_factory.mktemp("study"), llama_path, tasks_dir)


@pytest.fixture(scope="module")
def runs(ray_cluster, study, tmp_path_factory):
    """The study swept on 1 and on 3 workers: {workers: output folder}."""
    out = {}
    for workers in (1, 3):
        folder = tmp_path_factory.mktemp(f"out{workers}")
        code, output = sweep_cli(study, "--workers", workers, "--output", folder)
        assert code == 0, output
        assert "the baseline did not" not in output  # every configuration's lm-eval requests came from the grid
        out[workers] = folder
    return out


def test_one_and_three_workers_give_the_same_table(runs):
    one, three = (report.read_csv(runs[w] / "results.csv") for w in (1, 3))
    assert [(r["config"], r["task"], r["metric"]) for r in one] == [(r["config"], r["task"], r["metric"]) for r in three]
    for a, b in zip(one, three):
        assert abs(a["value"] - b["value"]) <= 1e-5 * max(1.0, abs(b["value"])), (a, b)
    gens = [[json.loads(line)["text"] for line in open(runs[w] / "generations.jsonl")] for w in (1, 3)]
    assert gens[0] == gens[1] and len(gens[0]) == 5 * len(PROMPTS)
    assert json.loads((runs[3] / "run.json").read_text())["workers"] == 3


def test_a_sweep_on_two_groups_of_two_gives_the_same_table(runs, study, tmp_path):
    """The sweep file's model block asks for groups of 2 (pipeline): on the 4-node cluster, 2 groups, each holding the
    model split over 2 nodes; every number and generation equals the unsplit single worker's."""
    grouped = study.parent / "grouped.yaml"
    text = study.read_text().replace("max_batch_tokens: 128}", "max_batch_tokens: 128, group_size: 2, split: pipeline}")
    assert text != study.read_text()
    grouped.write_text(text)
    code, output = sweep_cli(grouped, "--workers", 2, "--output", tmp_path)
    assert code == 0, output
    one, two = (report.read_csv(folder / "results.csv") for folder in (runs[1], tmp_path))
    assert [(r["config"], r["task"], r["metric"]) for r in one] == [(r["config"], r["task"], r["metric"]) for r in two]
    for a, b in zip(one, two):
        assert abs(a["value"] - b["value"]) <= 1e-5 * max(1.0, abs(b["value"])), (a, b)
    gens = [[json.loads(line)["text"] for line in open(folder / "generations.jsonl")] for folder in (runs[1], tmp_path)]
    assert gens[0] == gens[1]
    facts = json.loads((tmp_path / "run.json").read_text())
    assert facts["workers"] == 2 and facts["nodes"] == 4, facts  # 2 groups over 4 distinct nodes


def test_outputs_have_one_row_per_configuration_and_metric_and_valid_plots(runs, study):
    import matplotlib.image

    folder = runs[1]
    rows = report.read_csv(folder / "results.csv")
    configs = {r["config"] for r in rows}
    assert len(configs) == 1 + 2 * 2  # the baseline + 2 layers × 2 alphas
    assert len(rows) == len(configs) * (TASK_METRICS + PROMPT_METRICS)
    assert rows == [json.loads(line) for line in open(folder / "results.jsonl")]
    baseline = [r for r in rows if r["config"] == "baseline"]
    assert all(r["alpha"] == 0.0 and r["layer"] is None and r["delta"] == 0.0 for r in baseline)
    diff = {(r["layer"], r["alpha"]): r["value"] for r in rows if r["metric"] == "logprob_diff"}
    assert len(set(diff.values())) == len(diff)  # every configuration changed the behaviour score
    assert any(r["stderr"] is not None for r in rows if r["task"] == "orchard_mc")
    assert all(r["n"] == 4 for r in rows if r["metric"] not in ("fluency_logprob", "repetition_rate"))  # those: non-empty texts
    assert all(r["error"] is None and r["fluent"] in (True, False) for r in rows)
    pngs = sorted(p for p in (folder / "plots").glob("*.png") if p.name.startswith(("heatmap-", "lines-")))
    assert len(pngs) == 2 * (TASK_METRICS + PROMPT_METRICS)
    assert {p.name for p in (folder / "plots").glob("steerability-*.png")} == {"steerability-prompts.png", "steerability-orchard_mc.png"}
    heat = tuple(int(x * plots.DPI) for x in reversed(plots.heatmap_size(2, 3)))  # alphas -2, 0 (baseline), 2
    lines = tuple(int(x * plots.DPI) for x in reversed(plots.lines_size(1)))
    for png in pngs:
        image = matplotlib.image.imread(png)
        assert image.shape[:2] == (heat if png.name.startswith("heatmap-") else lines), png.name
        assert image.std() > 0.01  # not blank
    assert len(list((folder / "lm-eval").glob("*.json"))) == len(configs)
    text = (folder / "summary.md").read_text()
    assert "## Baseline" in text and "largest change" in text and "requests/s" in text
    assert "plots/heatmap-prompts-logprob_diff.png" in text


def test_a_configuration_equals_an_independent_steered_run(runs, study, tasks_dir):
    """The sweep's lm-eval metrics for one configuration equal `simple_evaluate` of a model built with that steering."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from driver.sweep import load_sweep

    sweep = load_sweep(study)
    config = next(c for c in sweep.grid if c.layer == 1 and c.alpha == 2.0)
    args = {k: v for k, v in sweep.model_args.items() if k != "threads"}
    ours = lm_eval.simple_evaluate(
        model="mlx", model_args={**args, "steer": config.steering}, tasks=["orchard_mc", "orchard_ppl", "orchard_gen"],
        limit=4, task_manager=TaskManager(include_path=str(tasks_dir)), verbosity="ERROR",
    )  # fmt: skip
    rows = {(r["task"], r["metric"]): r["value"] for r in report.read_csv(runs[1] / "results.csv") if r["config"] == config.id}
    for task, metrics in ours["results"].items():
        for name, value in metrics.items():
            if "," in name and "_stderr" not in name:
                assert rows[(task, name.split(",")[0])] == pytest.approx(value, rel=1e-5, abs=1e-6), (task, name)
    recorded = json.loads((runs[1] / "lm-eval" / f"{report.slug(config.id)}.json").read_text())
    assert recorded["config"]["orchard"]["steering"]["key"] == config.steering.key()


# --- resume -----------------------------------------------------------------------------------------------------


def assert_same_results(a: Path, b: Path) -> None:
    """Two results.csv files: the same rows, numbers within 1e-5 (a resumed run batches its requests otherwise)."""
    import csv

    rows_a, rows_b = (list(csv.DictReader(p.open())) for p in (a, b))
    assert len(rows_a) == len(rows_b)
    for x, y in zip(rows_a, rows_b):
        for column in x:
            if column in ("value", "stderr", "delta", "delta_low", "delta_high") and x[column] and y[column]:
                assert float(x[column]) == pytest.approx(float(y[column]), rel=1e-5, abs=1e-5), (column, x, y)
            else:
                assert x[column] == y[column], (column, x, y)


def fluency_requests(folder: Path) -> set[tuple[str, str]]:
    """The (prompt, text) pairs a sweep scores under the unsteered model: its distinct non-empty generations."""
    return {(g["prompt"], g["text"]) for g in map(json.loads, open(folder / "generations.jsonl")) if g["text"]}


def _rows(cache: Path) -> int:
    try:
        with sqlite3.connect(cache / "results.sqlite") as db:
            return db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    except sqlite3.Error:
        return 0


def test_an_interrupted_sweep_resumes_and_a_grown_grid_computes_only_new_cells(ray_cluster, llama_path, tasks_dir, tmp_path):
    alphas = (-3.0, -2.0, -1.0, 1.0, 2.0, 3.0)
    sweep = write_study(tmp_path / "study", llama_path, tasks_dir, tasks=False, alphas=alphas, max_gen_toks=32)
    total = (1 + 2 * len(alphas)) * 3 * len(PROMPTS)  # 2 targets + 1 generation per prompt and configuration
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # torch hidden
    address = session_address()  # a real process to interrupt, on the session's cluster (no embedded Ray of its own)
    proc = subprocess.Popen(
        [sys.executable, "-m", "driver", "sweep", str(sweep), "--workers", "1", "--address", address, "--threads", "1",
         "--output", str(out)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        until(lambda: _rows(out / "cache") > 0 or proc.poll() is not None, 300, 0.05)  # polls: no cost when a row comes sooner
        proc.send_signal(signal.SIGINT)  # Ctrl-C mid-sweep
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    finished = _rows(out / "cache")
    assert proc.returncode == 130 and "rerun the same command to resume" in output, output[-2000:]
    assert 0 < finished < total, (finished, total)
    assert not (out / "results.csv").exists()  # nothing half-written
    code, output = sweep_cli(sweep, "--workers", "2", "--output", out)
    assert code == 0, output
    facts = json.loads((out / "run.json").read_text())
    scored = fluency_requests(out)  # + the baseline's log-likelihood of each distinct generation
    assert facts["requests_computed"] == total + len(scored) - finished  # nothing finished is computed again
    assert facts["requests_cached"] == finished
    fresh = tmp_path / "fresh"
    code, output = sweep_cli(sweep, "--workers", "2", "--output", fresh)
    assert code == 0, output
    assert json.loads((fresh / "run.json").read_text())["requests_computed"] == total + len(scored)
    assert fluency_requests(fresh) == scored
    assert_same_results(out / "results.csv", fresh / "results.csv")
    assert (out / "generations.jsonl").read_text() == (fresh / "generations.jsonl").read_text()
    # a grown grid (another alpha) on the same cache: only its 2 new configurations are computed
    grown = sweep.parent / "grown.yaml"
    grown.write_text(sweep.read_text().replace("alphas: [-3.0,", "alphas: [4.0, -3.0,"))
    code, output = sweep_cli(grown, "--workers", "2", "--output", fresh)
    assert code == 0, output
    facts = json.loads((fresh / "run.json").read_text())
    new_texts = fluency_requests(fresh) - scored
    assert (facts["requests_computed"], facts["requests_cached"]) == (2 * 3 * len(PROMPTS) + len(new_texts), total + len(scored))
    old = {(r["config"], r["metric"]): r["value"] for r in report.read_csv(out / "results.csv")}
    new = report.read_csv(fresh / "results.csv")
    assert len(new) == (1 + 2 * (len(alphas) + 1)) * PROMPT_METRICS
    for r in new:  # the old configurations' values come back from the cache (the resumed run's: within 1e-5)
        if r["alpha"] != 4.0:
            assert r["value"] == pytest.approx(old[(r["config"], r["metric"])], rel=1e-5, abs=1e-5), r


# --- bad sweep files --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (("grid:", "grid:\n  alpha: [1]"), "grid.alpha: unknown field (did you mean 'alphas'?"),
        (("alphas: [-2.0, 2.0]", "alphas: [0]"), "grid: empty"),
        (("alphas: [-2.0, 2.0]", "alphas: [2.0, 1.0e+39]"), "grid.alphas: 1e+39 (vector v, layer 0, resid_post, add): alpha"),
        (("layers: all", "layers: [0, 5]"), "grid.layers: 5 is out of range for a model with 2 layers"),
        (("file: v.safetensors", "file: missing.safetensors"), "vectors.v.file"),
        (("names: [orchard_mc,", "names: [no_such_task,"), "tasks.names: unknown task 'no_such_task'"),
        ("prompts", "prompts.jsonl: line 2: not valid JSON"),
        (("max_gen_toks: 6", "max_gen_toks: 64"), "prompts[0].max_gen_toks: 64 must be less than the context window (64)"),
        (("max_gen_toks: 6", "max_gen_toks: 6, target_score: avg"), "prompts[0].target_score: 'avg' is not allowed (use 'sum' or 'mean')"),
        (("batch_size: 4,", "batch_size: 4, group_size: 0,"), "model.group_size: too small: give an integer >= 1"),
        (("batch_size: 4,", "batch_size: 4, split: ring,"), "model.split: unknown value (choose one of auto, pipeline, tensor), not 'ring'"),
        (("layers: all", "layers: all\n  heads: all"), "grid: heads: site resid_post has no heads: add attn_head to grid.sites, or remove grid.heads"),
        (("layers: all", "layers: all\n  sites: [attn_head]"), "grid: sites: attn_head steers one attention head at a time: give grid.heads"),
        (("layers: all", "layers: all\n  sites: [attn_head]\n  heads: [0, 4]"),
         "grid.heads: 4 is out of range for a model with 4 attention heads (use 0..3, or all)"),
        (("normalize: true}\ngrid:\n  layers: all", "normalize: true, key: 'resid_post.{layer}'}\ngrid:\n  layers: all\n  sites: [attn_head]\n  heads: [1]"),
         "vectors.v: has 64 values but attn_head takes head_dim = 16 values (one head's output, before the output projection) (layer 0, site attn_head, head 1)"),
        (("layers: all", "layers: all\n  sites: [attn_out, mlp_output]"), "grid.sites[1]: 'mlp_output' is not allowed (use 'resid_pre', 'resid_mid'"),
    ],
)
def test_bad_sweep_files_are_refused_in_one_line_before_any_worker(llama_path, tasks_dir, tmp_path, change, message):
    if change == "prompts":
        sweep = write_study(tmp_path, llama_path, tasks_dir, prompts='{"prompt": "a", "targets": {"positive": " b"}}\n{"prompt": \n')
    else:
        sweep = write_study(tmp_path, llama_path, tasks_dir)
        old, new = change
        assert old in sweep.read_text()
        sweep.write_text(sweep.read_text().replace(old, new))
    out = tmp_path / "out"
    # An unreachable cluster: the file is refused before anything tries to reach it.
    code, output = sweep_cli(sweep, "--workers", "1", "--address", "127.0.0.1:1", "--output", out)
    assert code == 1, output
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], output
    assert "Traceback" not in output and "127.0.0.1:1" not in output
    assert not out.exists()


def test_sweep_help():
    result = CliRunner().invoke(main, ["sweep", "--help"])
    assert result.exit_code == 0 and "SWEEP_FILE" in result.output and "--workers" in result.output


# --- numbers checked against the in-process model (issue 15: wrong numbers passed every other test) -------------


def label(r: dict) -> str:
    head = "" if r.get("head") is None else f" head {r['head']}"
    return f"{r['vector']} L{r['layer']} {r['site']}{head} {r['op']} α={r['alpha']:g} ({r['positions']})"


def test_scores_deltas_and_p_positive_equal_the_in_process_models(runs, study):
    """Every configuration's target scores, logprob_diff, p_positive and their deltas, recomputed from the
    in-process `mlx` model's log-probs of each (prompt, target) under that configuration's steering."""
    from lm_eval.api.instance import Instance

    from driver.lm.mlx import MLXLM
    from driver.sweep import load_sweep

    sweep = load_sweep(study)
    found = {(r["config"], r["metric"]): r for r in report.read_csv(runs[1] / "results.csv") if r["task"] == "prompts"}
    lm = MLXLM(**{k: v for k, v in sweep.model_args.items() if k != "threads"})
    requests = [Instance("loglikelihood", {}, (p, t), 0) for p, a, b in PROMPTS for t in (a, b)]
    expected = {}
    for config in sweep.configs:
        with lm.steered(config.steering):
            scores = np.array([ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)])
        pos, neg = scores[0::2], scores[1::2]
        expected[config.id] = {"logprob_positive": pos.mean(), "logprob_negative": neg.mean(),
                               "logprob_diff": (pos - neg).mean(), "p_positive": (1 / (1 + np.exp(neg - pos))).mean()}  # fmt: skip
    for config in sweep.configs:
        for metric, want in expected[config.id].items():
            row = found[(config.id, metric)]
            assert row["value"] == pytest.approx(want, abs=1e-4), (config.id, metric)
            assert row["delta"] == pytest.approx(want - expected["baseline"][metric], abs=1e-4), (config.id, metric)
    assert len({round(e["p_positive"], 3) for e in expected.values()}) > 1  # the check can tell configurations apart


def test_fluency_is_the_unsteered_models_per_token_score_of_each_text_and_decides_fluent(runs, study):
    from lm_eval.api.instance import Instance

    from driver.sweep import fluency
    from driver.lm.mlx import MLXLM
    from driver.sweep import load_sweep

    gens = [json.loads(line) for line in open(runs[1] / "generations.jsonl")]
    said = [g for g in gens if g["text"]]
    lm = MLXLM(**{k: v for k, v in load_sweep(study).model_args.items() if k != "threads"})
    scores = lm.loglikelihood([Instance("loglikelihood", {}, (g["prompt"], g["text"]), 0) for g in said], disable_tqdm=True)
    for g, (logprob, _) in zip(said, scores):
        n = len(lm._encode_pair(g["prompt"], g["text"])[1])
        assert g["fluency_logprob"] == pytest.approx(logprob / n, abs=1e-4), g
    assert fluency.repetition_rate("of of of of of") == pytest.approx(2 / 3)  # 3 trigrams, 1 distinct
    assert fluency.repetition_rate("the cat sat on the mat") == 0.0
    rows = report.read_csv(runs[1] / "results.csv")
    value = {(r["config"], r["metric"]): r["value"] for r in rows if r["task"] == "prompts"}
    for config in {r["config"] for r in rows} - {"baseline"}:
        mine = [g for g in gens if g["config"] == config]
        texts = [g for g in mine if g["text"]]
        assert value[(config, "fluency_logprob")] == pytest.approx(np.mean([g["fluency_logprob"] for g in texts]), abs=1e-6)
        assert value[(config, "repetition_rate")] == pytest.approx(np.mean([fluency.repetition_rate(g["text"]) for g in texts]))
        empty = lambda c: np.mean([not g["text"] for g in gens if g["config"] == c])  # noqa: E731
        fluent = (value[(config, "fluency_logprob")] >= value[("baseline", "fluency_logprob")] - fluency.LOGPROB_MARGIN
                  and value[(config, "repetition_rate")] <= value[("baseline", "repetition_rate")] + fluency.REPETITION_MARGIN
                  and empty(config) <= empty("baseline") + fluency.EMPTY_MARGIN)  # fmt: skip
        assert {r["fluent"] for r in rows if r["config"] == config} == {fluent}, config


def test_best_is_the_best_value_among_fluent_configurations(runs):
    rows = report.read_csv(runs[1] / "results.csv")
    text = (runs[1] / "summary.md").read_text()
    per_metric = text[text.index("## Per metric") :].splitlines()
    for metric, higher in (("logprob_diff", True), ("logprob_negative", False), ("p_positive", True)):
        line = next(x for x in per_metric if x.startswith(f"| prompts | {metric} |"))
        assert line.split(" | ")[3].startswith(best_by_hand(rows, metric, higher)), line
    # the rule itself, on rows where each choice gives a different answer
    rows = [{"config": c, "value": v, "delta": v, "fluent": f} for c, v, f in (("a", 1.0, True), ("b", 3.0, False), ("c", 2.0, True))]
    assert summary.extremes(rows, True)[0]["config"] == "c"  # b is higher but not fluent
    assert summary.extremes(rows, False)[0]["config"] == "a"
    assert summary.extremes(rows, None)[1]["config"] == "b"  # the largest change is any configuration's


def best_by_hand(rows: list[dict], metric: str, higher: bool) -> str:
    """summary.md's best cell recomputed: the best value among fluent steering configurations whose paired 95 %
    interval lies wholly on the better side of 0, else the sentence saying none does."""
    grid = [r for r in rows if r["task"] == "prompts" and r["metric"] == metric and r["config"] != "baseline"]
    beyond = [r for r in grid if r["fluent"] is not False and r["delta_low"] is not None
              and (r["delta_low"] > 0 if higher else r["delta_high"] < 0)]  # fmt: skip
    if beyond:
        return label((max if higher else min)(beyond, key=lambda r: r["value"])) + (" (highest)" if higher else " (lowest)")
    noise = not any(r["delta_low"] is not None and (r["delta_low"] > 0 or r["delta_high"] < 0) for r in grid)
    return summary.NOISE if noise else summary.NO_GAIN


def strict_json(text: str):
    def refuse(name: str):
        raise AssertionError(f"bare {name} in JSON output")

    return json.loads(text, parse_constant=refuse)


def test_an_extreme_alpha_is_a_failed_cell_and_every_output_stays_valid(ray_cluster, llama_path, tasks_dir, tmp_path):
    """replace with alpha 3e38 (finite in float32, but the residual stream overflows): its configurations fail, with
    the reason, never as acc 0; the JSON outputs
    stay strict JSON; a previous sweep's outputs in the folder are replaced, the cache and other files kept."""
    sweep = write_study(tmp_path / "study", llama_path, tasks_dir, alphas=(2.0, 3.0e38), extra="")
    sweep.write_text(sweep.read_text().replace("3e+38", "3.0e+38").replace("  alphas:", "  ops: [replace]\n  alphas:"))
    out = tmp_path / "out"
    for stale in ("plots/heatmap-gone-acc.png", "lm-eval/gone.json", "results.csv", "summary.md"):
        (out / stale).parent.mkdir(parents=True, exist_ok=True)
        (out / stale).write_text("an earlier sweep's")
    (out / "notes.txt").write_text("mine")
    code, output = sweep_cli(sweep, "--workers", "1", "--output", out)
    assert code == 0, output
    assert "warning: 2 configuration(s) failed with a non-finite score" in output
    assert "removed 2 output file(s) of an earlier sweep" in output
    assert not (out / "plots/heatmap-gone-acc.png").exists() and not (out / "lm-eval/gone.json").exists()
    assert (out / "notes.txt").read_text() == "mine" and (out / "cache" / "results.sqlite").exists()
    rows = [strict_json(line) for line in open(out / "results.jsonl")]
    assert rows == report.read_csv(out / "results.csv")
    for r in rows:
        if r["alpha"] == 3.0e38 and r["metric"] not in ("repetition_rate",):
            assert r["value"] is None and r["delta"] is None and r["error"], r  # never acc 0
        elif r["alpha"] != 3.0e38:
            assert r["error"] is None and r["value"] is not None, r
    reasons = {r["error"] for r in rows if r["error"]}
    assert any(x.startswith("non-finite log-likelihood: target 'positive' of prompts.jsonl line 1") for x in reasons), reasons
    assert any(re.fullmatch(r"non-finite log-likelihood in (\d+) of \1 lm-eval requests", x) for x in reasons), reasons
    facts = strict_json((out / "run.json").read_text())
    assert sorted(facts["failed"]) == sorted(r["config"] for r in rows if r["alpha"] == 3.0e38 and r["metric"] == "acc")
    for path in (out / "lm-eval").glob("*.json"):
        strict_json(path.read_text())
    gens = [strict_json(line) for line in open(out / "generations.jsonl")]
    failed = [g for g in gens if g["alpha"] == 3.0e38]
    assert failed and all(g["fluent"] is False and g["empty"] == (g["text"] == "") for g in failed)
    text = (out / "summary.md").read_text()
    assert "## Failed configurations" in text and "v L0 resid_post replace α=3e+38 (all)" in text


def test_a_configuration_that_fails_only_while_generating_is_set_aside(ray_cluster, llama_path, tasks_dir, tmp_path):
    """No targets, no tasks: the worker's refusal to generate from NaN scores is found per configuration."""
    from driver.sweep.grid import FAILED_GENERATING

    prompts = "".join(json.dumps({"prompt": p}) + "\n" for p, _, _ in PROMPTS)
    sweep = write_study(tmp_path / "study", llama_path, tasks_dir, tasks=False, alphas=(2.0, 3.0e38), prompts=prompts)
    sweep.write_text(sweep.read_text().replace("3e+38", "3.0e+38").replace("  alphas:", "  ops: [replace]\n  alphas:"))
    code, output = sweep_cli(sweep, "--workers", "1", "--output", tmp_path / "out")
    assert code == 0, output
    gens = [strict_json(line) for line in open(tmp_path / "out" / "generations.jsonl")]
    assert {g["alpha"] for g in gens if g["error"] == FAILED_GENERATING} == {3.0e38}
    assert all(g["text"] == "" and g["fluent"] is False for g in gens if g["error"])
    assert all(g["text"] for g in gens if g["alpha"] == 2.0)  # the others generated
    facts = strict_json((tmp_path / "out" / "run.json").read_text())
    assert len(facts["failed"]) == 2 and all(FAILED_GENERATING in why for why in facts["failed"].values())


def test_unequal_targets_and_long_prompts_are_said_once_and_mean_divides_by_tokens(ray_cluster, llama_path, tasks_dir, tmp_path):
    from driver.lm.mlx import MLXLM

    long = "Once upon a time " * 20 + "the dog was"
    prompts = "".join(json.dumps({"prompt": p, "targets": {"positive": " happy", "negative": " very very sad"}}) + "\n"
                      for p in ("The little dog was", long))  # fmt: skip
    sweep = write_study(tmp_path / "study", llama_path, tasks_dir, tasks=False, alphas=(2.0,), prompts=prompts)
    code, output = sweep_cli(sweep, "--workers", "1", "--output", tmp_path / "sum", "--cache", tmp_path / "cache")
    assert code == 0, output
    lines = output.splitlines()
    assert sum("targets of unequal token length" in x for x in lines) == 1, output
    assert sum("left-truncated" in x for x in lines) == 1 and "2 target requests and 1 generation prompts" in output, output
    mean = sweep.parent / "mean.yaml"
    mean.write_text(sweep.read_text().replace("max_gen_toks: 6}", "max_gen_toks: 6, target_score: mean}"))
    code, output = sweep_cli(mean, "--workers", "1", "--output", tmp_path / "mean", "--cache", tmp_path / "cache")
    assert code == 0, output
    assert "unequal token length" not in output
    lm = MLXLM(pretrained=str(llama_path), max_length=64)
    tokens = {t: len(lm._encode_pair("The little dog was", t)[1]) for t in (" happy", " very very sad")}
    assert tokens[" happy"] != tokens[" very very sad"]
    summed, per_token = ({(r["config"], r["metric"]): r["value"] for r in report.read_csv(tmp_path / d / "results.csv")} for d in ("sum", "mean"))
    for (config, metric), value in summed.items():
        n = {"logprob_positive": tokens[" happy"], "logprob_negative": tokens[" very very sad"]}.get(metric)
        if n is not None:
            assert per_token[(config, metric)] == pytest.approx(value / n, rel=1e-5), (config, metric)


# --- one writer per output folder; tasks looked up fast -----------------------------------------------------------


def test_a_second_sweep_into_a_busy_folder_is_refused_and_a_dead_holder_does_not_block(study, tmp_path, monkeypatch):
    import driver.sweep

    def no_work(*args, **kwargs):
        raise AssertionError("the sweep file was loaded (lm-eval's task index, the model's config) before the refusal")

    monkeypatch.setattr(driver.sweep, "load_sweep", no_work)
    busy = tmp_path / "busy"
    held = outdir.lock(busy)
    try:
        code, output = sweep_cli(study, "--workers", "1", "--address", "127.0.0.1:1", "--output", busy)
    finally:
        outdir.unlock(held)
    errors = [x for x in output.splitlines() if x.startswith("Error:")]
    assert code == 1 and len(errors) == 1 and "another sweep is writing to this folder" in errors[0], output
    assert [p.name for p in busy.iterdir()] == [outdir.LOCK_NAME]  # nothing written
    holder = subprocess.run(  # a sweep killed while it held the lock
        [sys.executable, "-c", f"import os, signal; from driver.sweep import outdir; outdir.lock({str(busy)!r}); os.kill(os.getpid(), signal.SIGKILL)"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )  # fmt: skip
    assert holder.returncode == -signal.SIGKILL
    outdir.unlock(outdir.lock(busy))  # its lock died with it


def test_an_unknown_task_is_refused_before_lm_eval_indexes_its_tasks(llama_path, tasks_dir, tmp_path, monkeypatch):
    import lm_eval.tasks

    from driver import sweep as sweep_module
    from driver.sweep import plan

    def no_index(*args, **kwargs):
        raise AssertionError("lm-eval's task index was built")

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", no_index)
    monkeypatch.setattr(plan, "_MANAGERS", {})
    path = write_study(tmp_path, llama_path, tasks_dir)
    path.write_text(path.read_text().replace("names: [orchard_mc,", "names: [orchard_mcq,"))
    with pytest.raises(sweep_module.SweepError, match="tasks.names: unknown task 'orchard_mcq'"):
        sweep_module.load_sweep(path)


# --- every site, and single heads (issue 18) ----------------------------------------------------------------------


def site_study(folder: Path, llama_path, tasks_dir, sites: str, vectors: dict[str, np.ndarray], extra: str = "") -> Path:
    """A prompts-only sweep (targets, no generations) at `sites` (the grid's YAML list) with `vectors` as v.safetensors."""
    sweep = write_study(folder, llama_path, tasks_dir, tasks=False, alphas=(-2.0, 2.0))
    save_file(vectors, str(folder / "v.safetensors"))
    text = sweep.read_text().replace("  layers: all\n", f"  layers: all\n  sites: {sites}\n{extra}")
    sweep.write_text(text.replace("max_gen_toks: 6}", "max_gen_toks: 6, generate: false}"))
    return sweep


def plain_scores(sweep_path: Path, interventions: list[dict]) -> dict[str, float]:
    """logprob_positive / _negative / _diff of the prompt set in one plain steered run of the in-process `mlx` model,
    its steering built from a spec as `driver run` builds it (not from the sweep's configurations)."""
    from lm_eval.api.instance import Instance

    from driver.lm.mlx import MLXLM
    from driver.lm.model_setup import model_config
    from driver.steering.spec import for_model
    from driver.sweep import load_sweep

    args = {k: v for k, v in load_sweep(sweep_path).model_args.items() if k != "threads"}
    steering = for_model({"interventions": interventions}, model_config(args["pretrained"], None), base_dir=sweep_path.parent).steering
    lm = MLXLM(**args, steer=steering) if interventions else MLXLM(**args)
    requests = [Instance("loglikelihood", {}, (p, t), 0) for p, a, b in PROMPTS for t in (a, b)]
    scores = np.array([ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)])
    pos, neg = scores[0::2], scores[1::2]
    return {"logprob_positive": pos.mean(), "logprob_negative": neg.mean(), "logprob_diff": (pos - neg).mean()}


def assert_equals_plain_runs(rows: list[dict], sweep_path: Path, spec_of) -> dict:
    """Every configuration's target scores equal a plain steered run of `spec_of(row)` (one intervention) within 1e-5;
    returns {config: logprob_diff}."""
    diffs = {}
    for config in sorted({r["config"] for r in rows}):
        mine = {r["metric"]: r for r in rows if r["config"] == config and r["task"] == "prompts"}
        first = mine["logprob_diff"]
        want = plain_scores(sweep_path, [] if config == "baseline" else [spec_of(first)])
        for metric, value in want.items():
            assert mine[metric]["value"] == pytest.approx(value, rel=1e-5, abs=1e-5), (config, metric)
        diffs[config] = first["value"]
    return diffs


def test_a_sweep_over_branch_sites_equals_plain_steered_runs_per_site(ray_cluster, llama_path, tasks_dir, tmp_path):
    """sites [attn_out, mlp_out, resid_mid] on 2 workers: each configuration's numbers equal a plain steered run
    at that site (layer 0: steered from block 0 on; layer 1: its block 0 shared below the split); results.csv,
    summary.md and the layers × alphas plots name each site."""
    import matplotlib.image

    rng = np.random.default_rng(7)
    sites = ("attn_out", "mlp_out", "resid_mid")
    vectors = {f"{s}.{i}": rng.standard_normal(HIDDEN).astype(np.float32) for s in sites for i in range(2)}
    sweep = site_study(tmp_path / "study", llama_path, tasks_dir, "[attn_out, mlp_out, resid_mid]", vectors)
    out = tmp_path / "out"
    code, output = sweep_cli(sweep, "--workers", 2, "--output", out)
    assert code == 0, output
    rows = report.read_csv(out / "results.csv")
    assert {(r["site"], r["layer"], r["alpha"], r["head"]) for r in rows if r["config"] != "baseline"} == {
        (s, layer, a, None) for s in sites for layer in (0, 1) for a in (-2.0, 2.0)}

    def spec_of(r: dict) -> dict:
        key = f"{r['site']}.{r['layer']}"
        return {"layer": r["layer"], "site": r["site"], "alpha": r["alpha"], "normalize": True, "vector": {"file": "v.safetensors", "key": key}}

    diffs = assert_equals_plain_runs(rows, sweep, spec_of)
    assert len({round(d, 4) for d in diffs.values()}) == len(diffs)  # every site, layer and alpha changed the score
    text = (out / "summary.md").read_text()
    assert "| v | attn_out, mlp_out, resid_mid | – | 0, 1 |" in text
    assert f"| prompts | logprob_diff | {summary._num(diffs['baseline'])} | {best_by_hand(rows, 'logprob_diff', True)} |" in text
    heat = tuple(int(x * plots.DPI) for x in reversed(plots.heatmap_size(2, [3, 3, 3])))  # one panel per site
    image = matplotlib.image.imread(out / "plots" / "heatmap-prompts-logprob_diff.png")
    assert image.shape[:2] == heat
    assert not list((out / "plots").glob("heads-*.png"))


HEADS, HEAD_DIM = 4, 16  # conftest's tiny llama: 4 attention heads of 16


def test_a_head_sweep_equals_plain_steered_runs_per_head_and_draws_layers_by_heads(ray_cluster, llama_path, tasks_dir, tmp_path):
    """sites [attn_head], heads all (the model's 4), vectors keyed attn_head.{layer}.{head} as `driver vectors --heads
    all` writes them: each configuration equals a plain steered run at that head; the report names each head and
    draws a layers × heads heatmap per metric (one panel per alpha), no layers × alphas plots."""
    import matplotlib.image

    rng = np.random.default_rng(11)
    vectors = {f"attn_head.{layer}.{h}": rng.standard_normal(HEAD_DIM).astype(np.float32) for layer in range(2) for h in range(HEADS)}
    sweep = site_study(tmp_path / "study", llama_path, tasks_dir, "[attn_head]", vectors, extra="  heads: all\n")
    out = tmp_path / "out"
    code, output = sweep_cli(sweep, "--workers", 2, "--output", out)
    assert code == 0, output
    rows = report.read_csv(out / "results.csv")
    assert {(r["site"], r["layer"], r["head"], r["alpha"]) for r in rows if r["config"] != "baseline"} == {
        ("attn_head", layer, h, a) for layer in (0, 1) for h in range(HEADS) for a in (-2.0, 2.0)}

    def spec_of(r: dict) -> dict:
        key = f"attn_head.{r['layer']}.{r['head']}"
        return {"layer": r["layer"], "site": "attn_head", "head": r["head"], "alpha": r["alpha"], "normalize": True,
                "vector": {"file": "v.safetensors", "key": key}}  # fmt: skip

    diffs = assert_equals_plain_runs(rows, sweep, spec_of)
    assert len({round(d, 4) for d in diffs.values()}) == len(diffs)  # every head changed the score its own way
    pngs = sorted(p.name for p in (out / "plots").glob("heads-*.png"))
    assert pngs == sorted(f"heads-prompts-{m}.png" for m in ("logprob_positive", "logprob_negative", "logprob_diff", "p_positive"))
    heat = tuple(int(x * plots.DPI) for x in reversed(plots.heatmap_size(2, [HEADS, HEADS])))  # alphas -2 and 2
    for png in pngs:
        image = matplotlib.image.imread(out / "plots" / png)
        assert image.shape[:2] == heat and image.std() > 0.01, png
    text = (out / "summary.md").read_text()
    assert "| v | attn_head | 0, 1, 2, 3 | 0, 1 |" in text and "(plots/heads-prompts-logprob_diff.png)" in text
    best = best_by_hand(rows, "logprob_diff", True)
    assert f"| prompts | logprob_diff | {summary._num(diffs['baseline'])} | {best}" in text
    configurations = json.loads((out / "run.json").read_text())["configurations"]
    assert {c["head"] for c in configurations} == {None, *range(HEADS)}


def test_a_site_the_models_blocks_lack_is_refused_in_one_line_before_any_worker(llama_path, tasks_dir, tmp_path):
    """resid_mid on a family whose blocks run attention and MLP in parallel (config.json's model_type says so): the
    sweep file is refused as a `driver run` spec is (driver.steering.spec.for_model), before anything starts."""
    import shutil

    model = tmp_path / "parallel"
    shutil.copytree(llama_path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "cohere"}))
    vectors = {f"{s}.{i}": np.ones(HIDDEN, dtype=np.float32) for s in ("attn_out", "resid_mid") for i in range(2)}
    sweep = site_study(tmp_path / "study", model, tasks_dir, "[attn_out, resid_mid]", vectors)
    code, output = sweep_cli(sweep, "--workers", "1", "--address", "127.0.0.1:1", "--output", tmp_path / "out")
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert code == 1 and len(errors) == 1, output
    assert "vectors.v.site: the cohere block runs attention and MLP in parallel on the same input, so it has no resid_mid" in errors[0]
    assert "(layer 0, site resid_mid)" in errors[0] and not (tmp_path / "out").exists()


def test_a_grid_of_a_site_beside_heads_draws_each_its_own_plot():
    """attn_out (layers × alphas, lines) and attn_head (layers × heads, one panel per alpha) in one grid: each row
    lands in its own plot, each cell its own value."""
    import io

    import matplotlib.image

    def row(site, layer, alpha, head=None):
        delta = (layer or 0) + 10 * alpha + (0 if head is None else 100 * (head + 1))
        return {"config": f"{site}.{layer}.{head}.{alpha}", "vector": "v", "site": site, "head": head, "layer": layer, "op": "add",
                "positions": "all", "alpha": alpha, "value": delta, "delta": delta, "stderr": None}  # fmt: skip

    rows = [{**row(None, None, 0.0), "config": "baseline", "value": 0.0, "delta": 0.0}]
    rows += [row("attn_out", layer, a) for layer in (0, 1) for a in (-2.0, 2.0)]
    rows += [row("attn_head", layer, 2.0, h) for layer in (0, 1) for h in range(3)]
    sites, heads = plots.facets(rows), plots.facets(rows, plots.HEADS)
    assert list(sites) == [("v", "attn_out", "add", "all")] and list(heads) == [("v", "attn_head", "add", "all", 2.0)]
    assert plots.panel_axes(heads[("v", "attn_head", "add", "all", 2.0)], plots.HEADS) == ([0, 1], [0, 1, 2])
    assert plots.panel_axes(sites[("v", "attn_out", "add", "all")]) == ([0, 1], [-2.0, 0.0, 2.0])
    for png, size in ((plots.heatmap("t", "m", rows, plots.HEADS), plots.heatmap_size(2, [3])),
                      (plots.heatmap("t", "m", rows), plots.heatmap_size(2, [3])), (plots.lines("t", "m", rows), plots.lines_size(1))):
        image = matplotlib.image.imread(io.BytesIO(png))
        assert image.shape[:2] == tuple(int(x * plots.DPI) for x in reversed(size)) and image.std() > 0.01
    assert summary._config_label(rows[-1]) == "v L1 attn_head head 2 add α=2 (all)"


def test_a_npy_of_head_dim_values_steers_each_listed_head(llama_path, tasks_dir, tmp_path):
    """`heads: [0, 2]` with one .npy of head_dim values per layer: a configuration per (layer, head), each that vector
    at its own head; its results record names the head."""
    from driver.sweep import load_sweep

    sweep = site_study(tmp_path, llama_path, tasks_dir, "[attn_head]", {}, extra="  heads: [0, 2]\n")
    per_layer = {layer: np.arange(HEAD_DIM, dtype=np.float32) + 100 * layer for layer in (0, 1)}
    for layer, v in per_layer.items():
        np.save(tmp_path / f"h{layer}.npy", v)
    sweep.write_text(sweep.read_text().replace("v: {file: v.safetensors, normalize: true}", "v: {layers: {0: h0.npy, 1: h1.npy}}"))
    grid = load_sweep(sweep).grid
    assert [(c.layer, c.head, c.alpha) for c in grid] == [(layer, h, a) for layer in (0, 1) for h in (0, 2) for a in (-2.0, 2.0)]
    for c in grid:
        (iv,) = c.steering.interventions
        assert (iv.site, iv.layer, iv.head, iv.alpha) == ("attn_head", c.layer, c.head, c.alpha)
        assert np.array_equal(np.asarray(iv.vector, dtype=np.float32), per_layer[c.layer])
        assert c.record["spec"]["interventions"][0]["head"] == c.head and c.id == f"v.attn_head.L{c.layer}.h{c.head}.add.all.a{c.alpha:+g}"
