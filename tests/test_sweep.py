"""`driver sweep`: a layer × alpha grid on lm-eval tasks and a prompt set, on 1 and 3 real Ray workers (same
table), a configuration equal to an independent steered run, the outputs' shape, resume after a real
interrupted process, and bad sweep files refused in one line before any worker starts."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from driver import report
from driver.cli import main

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = 64  # conftest's tiny llama: 2 layers, hidden 64
PROMPTS = [
    ("The little dog was", " happy", " sad"),
    ("Once upon a time a girl felt", " happy", " sad"),
    ("The king said he was", " glad", " angry"),
    ("At night the cat was", " happy", " sad"),
]
TASK_METRICS = 5  # orchard_mc acc; orchard_ppl word_perplexity, byte_perplexity, bits_per_byte; orchard_gen exact_match
PROMPT_METRICS = 4  # logprob_positive, logprob_negative, logprob_diff, p_positive


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
    assert all(r["n"] == 4 for r in rows)
    plots = sorted((folder / "plots").glob("*.png"))
    assert len(plots) == 2 * (TASK_METRICS + PROMPT_METRICS)
    heat = tuple(int(x * report.DPI) for x in reversed(report.heatmap_size(2, 3)))  # alphas -2, 0 (baseline), 2
    lines = tuple(int(x * report.DPI) for x in reversed(report.lines_size(1)))
    for png in plots:
        image = matplotlib.image.imread(png)
        assert image.shape[:2] == (heat if png.name.startswith("heatmap-") else lines), png.name
        assert image.std() > 0.01  # not blank
    assert len(list((folder / "lm-eval").glob("*.json"))) == len(configs)
    summary = (folder / "summary.md").read_text()
    assert "## Baseline" in summary and "largest change" in summary and "requests/s" in summary
    assert "plots/heatmap-prompts-logprob_diff.png" in summary


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
            if column in ("value", "stderr", "delta") and x[column] and y[column]:
                assert float(x[column]) == pytest.approx(float(y[column]), rel=1e-5, abs=1e-5), (column, x, y)
            else:
                assert x[column] == y[column], (column, x, y)


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
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "driver", "sweep", str(sweep), "--workers", "1", "--address", "local", "--threads", "1",
         "--output", str(out)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while _rows(out / "cache") == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
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
    assert facts["requests_computed"] == total - finished  # nothing finished is computed again
    assert facts["requests_cached"] == finished
    fresh = tmp_path / "fresh"
    code, output = sweep_cli(sweep, "--workers", "2", "--output", fresh)
    assert code == 0, output
    assert json.loads((fresh / "run.json").read_text())["requests_computed"] == total
    assert_same_results(out / "results.csv", fresh / "results.csv")
    assert (out / "generations.jsonl").read_text() == (fresh / "generations.jsonl").read_text()
    # a grown grid (another alpha) on the same cache: only its 2 new configurations are computed
    grown = sweep.parent / "grown.yaml"
    grown.write_text(sweep.read_text().replace("alphas: [-3.0,", "alphas: [4.0, -3.0,"))
    code, output = sweep_cli(grown, "--workers", "2", "--output", fresh)
    assert code == 0, output
    facts = json.loads((fresh / "run.json").read_text())
    assert (facts["requests_computed"], facts["requests_cached"]) == (2 * 3 * len(PROMPTS), total)
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
        (("layers: all", "layers: [0, 5]"), "grid.layers: 5 is out of range for a model with 2 layers"),
        (("file: v.safetensors", "file: missing.safetensors"), "vectors.v.file"),
        (("names: [orchard_mc,", "names: [no_such_task,"), "tasks.names: unknown task 'no_such_task'"),
        ("prompts", "prompts.jsonl: line 2: not valid JSON"),
        (("max_gen_toks: 6", "max_gen_toks: 64"), "prompts[0].max_gen_toks: 64 must be less than the context window (64)"),
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
