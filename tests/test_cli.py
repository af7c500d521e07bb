"""`driver` on bad input: a one-line error naming the problem, the exact exit code (2: the command line is wrong,
1: what it names is not usable), no traceback. No cluster needed. (tests/test_errors.py runs the full table as
real subprocesses; these run in process, and check the Python API's model_args and the cache file rules.)"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from driver.cli import main
from testbed import inproc
from testbed.inproc import Completed
from testbed.waiting import until


def run(code: int, *args: str):
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.fixture
def common(llama_path, tasks_dir, tmp_path):
    return ["--model", str(llama_path), "--include-path", str(tasks_dir), "--output-path", str(tmp_path)]


def test_unknown_task(common):
    assert "unknown task no_such_task" in run(2, "run", *common, "--tasks", "no_such_task", "--workers", "1")


def test_missing_model(common, tmp_path):
    common[1] = str(tmp_path / "absent")
    assert "model path does not exist" in run(1, "run", *common, "--tasks", "orchard_mc", "--workers", "1")


def test_unreachable_address(common):
    error = run(1, "run", *common, "--tasks", "orchard_mc", "--workers", "1", "--address", "127.0.0.1:1")
    assert "cannot reach a Ray cluster at 127.0.0.1:1" in error


@pytest.mark.parametrize(
    "workers, message", [("0", "--workers 0: at least 1 worker is needed"), ("many", "--workers 'many' is not a number")]
)
def test_bad_worker_count(common, workers, message):
    assert message in run(2, "run", *common, "--tasks", "orchard_mc", "--workers", workers)


def test_real_entry_point_exits_non_zero_without_traceback(llama_path):
    proc = subprocess.run(
        [sys.executable, "-m", "driver", "run", "--model", str(llama_path), "--tasks", "x", "--workers", "0"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["Error: --workers 0: at least 1 worker is needed (or pass all for every mlx node)"]


def test_every_command_has_help():
    for command in ([], ["run"], ["demo"], ["nodes"], ["vectors"]):
        result = CliRunner().invoke(main, [*command, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output
    assert "--num-fewshot" in CliRunner().invoke(main, ["run", "--help"]).output


def test_usage_errors_are_one_line_with_one_hint(common):
    result = CliRunner().invoke(main, ["run", *common, "--tasks", "orchard_mc", "--batch-size", "0"])
    assert result.exit_code == 2
    assert result.output.splitlines() == ["Error: --batch-size 0: too small: give an integer >= 1 (rows per forward pass)"]
    result = CliRunner().invoke(main, ["run", "--tasks", "x"])
    assert result.exit_code == 2
    assert result.output.splitlines() == ["Error: Missing option '--model'.", "Try 'main run --help' for help."]


def test_an_unexpected_error_is_one_line_too(common, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr("driver.cli.run.writable_folder", broken)
    result = CliRunner().invoke(main, ["run", *common, "--tasks", "orchard_mc", "--workers", "1"])
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        "Error: internal error (KeyError: 'boom'); rerun with ORCHARD_TRACEBACK=1 for the traceback"
    ]


# --- the same rules from Python: model_args in the user's words ----------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_length": 1}, "model_args max_length=1: too small: give an integer >= 2"),
        ({"max_batch_tokens": "lots"}, "model_args max_batch_tokens=lots: not a whole number"),
        ({"batch_size": 0}, "model_args batch_size=0: too small"),
        ({"dtype": "float8"}, "model_args dtype=float8: unknown value (choose one of float32, float16, bfloat16)"),
        ({"prefix_reuse": "maybe"}, "model_args prefix_reuse=maybe: not a boolean"),
        ({"max_lenght": 64}, "unknown model_args for MLXLM: max_lenght (did you mean max_length?)"),
    ],
)
def test_python_model_args_are_checked_before_loading(llama_path, kwargs, message):
    from driver.lm.mlx import MLXLM

    with pytest.raises(ValueError) as info:
        MLXLM(pretrained=str(llama_path), **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("content", [b"not a database at all" * 8, "sqlite-foreign"])
def test_the_cache_refuses_a_foreign_file_and_leaves_it_alone(tmp_path, content):
    import sqlite3

    from driver.lm.cache import Cache

    path = tmp_path / "results.sqlite"
    if content == "sqlite-foreign":
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE results (id INTEGER, name TEXT)")  # the same table name, another program's
    else:
        path.write_bytes(content)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="move it away"):
        Cache(tmp_path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["results.sqlite"]


def test_the_cache_reopens_its_own_file(tmp_path):
    from driver.lm.cache import Cache

    cache = Cache(tmp_path)
    cache.put([(b"k", [1.0, True])])
    cache.close()
    again = Cache(tmp_path)
    assert again.get([b"k"]) == {b"k": [1.0, True]}
    again.close()


def test_settings_parsers_in_the_users_words():
    from driver.checks import settings

    assert settings.limit("0.5") == 0.5 and settings.limit("10") == 10 and settings.limit("10.0") == 10
    assert settings.gen_kwargs("temperature=0.7,top_k=5,until=\\n") == {"temperature": 0.7, "top_k": 5, "until": "\\n"}
    assert settings.model_args("dtype=float16,prefix_reuse=false", flags={}) == {"dtype": "float16", "prefix_reuse": False}
    with pytest.raises(settings.SettingError, match=r"--model-args: dtype is given twice"):
        settings.model_args("dtype=float16,dtype=float32", flags={})


def test_run_summaries_say_where_the_results_came_from():
    from driver.lm.evaluation import on_workers

    assert on_workers({"workers": 0, "nodes": 0, "address": None}) == "on no workers (every result came from the cache)"
    assert on_workers({"workers": 2, "nodes": 1, "address": "local"}, ray=True) == "on 2 workers on 1 node (Ray at local)"
    assert on_workers({"workers": 4, "nodes": 2, "address": "127.0.0.1:6379"}) == "on 4 workers on 2 nodes"


def test_run_summaries_report_the_prefix_stores(capsys):
    from driver.lm.evaluation import _print_summary, _summary, prefix_store_line

    stores = [{"hits": 3, "extended": 1, "tokens_reused": 900, "peak_bytes": 3 << 20, "budget": 1 << 30, "evicted": 0},
              {"hits": 2, "extended": 0, "tokens_reused": 400, "peak_bytes": 5 << 20, "budget": 1 << 30, "evicted": 2}]
    info = {"address": "local", "workers": 2, "workers_alive": 2, "nodes": 1, "requests_computed": {}, "requests_cached": 0,
            "seconds": 1.0, "cache": None, "facts": [], "prefix_store": stores}
    assert _summary(info, 2.0)["prefix_store"] == stores
    assert prefix_store_line(stores) == ("  prefix KV store: 5 hits, 1 extended, 1300 tokens reused, peak 5.0 of 1024 MiB "
                                         "per worker, 2 evicted")
    _print_summary(_summary(info, 2.0))
    assert prefix_store_line(stores) in capsys.readouterr().out.splitlines()
    _print_summary(_summary({**info, "prefix_store": [{**s, "peak_bytes": 0} for s in stores]}, 2.0))
    assert "prefix KV store" not in capsys.readouterr().out  # nothing stored (no generation): no line


# --- what a user meets in a real run: real subprocesses on an embedded Ray (issue 15) ------------------------------

NOISE = ("PyTorch was not found", "aggregation is not", "higher_is_better is not", "fatal:", "1 workers", "Traceback")


def driver_env(tmp_path) -> dict:
    """This process's environment, offline; torch stays hidden from the child, as on a user's install (conftest's
    `_children_without_torch` puts testbed/notorch on PYTHONPATH for every process the tests start)."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "PYTEST_"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", RAY_USAGE_STATS_ENABLED="0")
    return env


def driver(tmp_path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m driver ARGS` in `tmp_path` (not a git repository), offline, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "driver", *map(str, args)], capture_output=True, text=True, cwd=tmp_path,
        env=driver_env(tmp_path), timeout=timeout,
    )  # fmt: skip


def in_process(tmp_path, *args) -> Completed:
    """`driver ARGS` in `tmp_path` run in this process (testbed.inproc) on the session's cluster, which the test
    asks for (`ray_cluster`): `--address` is that cluster's, so no embedded Ray starts for the command."""
    return inproc.driver(*args, "--address", inproc.session_address(), cwd=tmp_path)


def one_error(proc: subprocess.CompletedProcess | Completed) -> str:
    shown = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, shown
    return errors[0]


def _metric(table: str, task: str, metric: str) -> float:
    """A value from lm-eval's printed table (a task's later metrics sit on rows with an empty task cell)."""
    current = None
    for row in table.splitlines():
        cells = [c.strip() for c in row.split("|")]
        if len(cells) < 8:
            continue
        current = cells[1] or current
        if current == task and cells[5] == metric:
            return float(cells[7])
    raise AssertionError(f"no {task} {metric} in:\n{table}")


@pytest.mark.slow
def test_demo_runs_the_real_model_and_its_numbers_mean_something(tmp_path):
    """The demo on TinyStories-260K: the coherent continuation is picked far above chance (1 in 4), short stories
    have a sane perplexity (a random-weight model: ~1e8 words), most sentences are finished with the right word."""
    proc = driver(tmp_path, "demo", "--workers", "1", "--dir", tmp_path / "demo")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _metric(proc.stdout, "tinystories_mc", "acc") >= 0.6
    assert _metric(proc.stdout, "tinystories_mc", "acc_norm") >= 0.6
    assert 5 < _metric(proc.stdout, "tinystories_ppl", "word_perplexity") < 60
    assert _metric(proc.stdout, "tinystories_ppl", "bits_per_byte") < 1.5
    assert _metric(proc.stdout, "tinystories_gen", "exact_match") >= 0.5
    assert "on 1 worker on 1 node" in proc.stdout
    assert "Lily loved her red → ball" in proc.stdout  # a generation, shown
    assert not [n for n in NOISE if n in proc.stdout + proc.stderr], proc.stderr[-3000:]
    assert _shape(proc.stdout.splitlines()) == _shape(_readme_demo()), proc.stdout  # the README shows what it prints


def _readme_demo() -> list[str]:
    """The lines README.md shows `driver demo` printing on stdout."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("```\n|     Tasks     |") + 4
    return text[start:text.index("```", start)].splitlines()


def _shape(lines: list[str]) -> list[str]:
    """What does not vary from run to run: the worker count, seconds, the rows per worker and the folders aside."""
    import re

    out: list[str] = []
    for line in lines:
        if re.fullmatch(r"  w\d+@\S+ +\d+ requests +[\d.]+ req/s", line):
            out += [] if out[-1] == "<a row per worker>" else ["<a row per worker>"]
            continue
        line = re.sub(r" in [\d.]+ s$", " in <seconds> s", re.sub(r"on \d+ workers? on", "on <workers> on", line))
        out.append(re.sub(r"^(results|tasks): .*", r"\1: <folder>", line))
    return out


@pytest.mark.slow
def test_a_run_is_quiet_about_what_the_user_cannot_change(llama_path, tasks_dir, tmp_path):
    """No PyTorch notice (Orchard never needs it), no lm-eval default-aggregation notes (orchard_ppl leaves them
    out), no git `fatal:` outside a repository, and "1 worker", in a real run without PyTorch."""
    proc = driver(
        tmp_path, "run", "--model", llama_path, "--tasks", "orchard_ppl", "--include-path", tasks_dir, "--workers", "1",
        "--limit", "1", "--output-path", tmp_path / "out",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on 1 worker on 1 node" in proc.stdout
    assert not [n for n in NOISE if n in proc.stdout + proc.stderr], proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_nan_log_likelihood_fails_the_run_in_one_line(stories_path, tmp_path):
    """Finite weights whose logits overflow (the final norm's weights at 3e38): every log-likelihood is NaN, which
    must fail the run naming the task and the document, never print `acc 0`."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    model = shutil.copytree(stories_path, tmp_path / "overflow")
    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], 3e38)
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    from testbed.stories import write_story_tasks

    tasks = write_story_tasks(tmp_path / "tasks")
    proc = in_process(tmp_path, "run", "--model", model, "--tasks", "tinystories_mc", "--include-path", tasks, "--workers", "1",
                      "--output-path", tmp_path / "out")  # fmt: skip
    assert one_error(proc) == (
        "Error: task tinystories_mc, document 0 (request 0 of that document): the log-likelihood is nan: check the "
        "model's weights (a damaged file) and the steering (its alpha and vectors)"
    )
    assert "acc" not in proc.stdout


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_non_finite_weights_fail_the_run_in_one_line(llama_path, tasks_dir, tmp_path):
    from worker.load import safetensors_header

    model = shutil.copytree(llama_path, tmp_path / "nan-model")
    weights = model / "model.safetensors"
    name, info = next(iter(sorted(safetensors_header(weights).items())))
    with weights.open("r+b") as fh:  # 4 KB of 0xFF (float32 NaNs) at the start of a tensor's data
        fh.seek(8 + int.from_bytes(weights.read_bytes()[:8], "little") + info["data_offsets"][0])
        fh.write(b"\xff" * min(4096, info["data_offsets"][1] - info["data_offsets"][0]))
    proc = in_process(tmp_path, "run", "--model", model, "--tasks", "orchard_mc", "--include-path", tasks_dir, "--workers", "1",
                      "--output-path", tmp_path / "out")  # fmt: skip
    assert f"{model}: weight {name} in model.safetensors holds NaN or infinite values: the file is damaged" in one_error(proc)


def _long_sweep(folder, model) -> str:
    """A sweep of 48 steering configurations generating up to 400 tokens for each of 12 prompts: minutes of work,
    so a signal sent a second after it starts lands mid-sweep (the tiny model often stops early at its EOS)."""
    import json

    import numpy as np

    np.save(folder / "v.npy", np.ones(64, dtype=np.float32))
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Once upon a time {i}"}) + "\n" for i in range(12)))
    sweep = f"""model:
  pretrained: {model}
vectors:
  v: {{file: v.npy}}
grid:
  layers: [0]
  alphas: [{", ".join(str(a / 8) for a in range(1, 49))}]
prompts:
  - {{file: prompts.jsonl, max_gen_toks: 400, until: ["QQQQ"]}}
"""
    (folder / "sweep.yaml").write_text(sweep)
    return str(folder / "sweep.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_sigterm_stops_a_run_like_ctrl_c(llama_path, tasks_dir, tmp_path, command):
    """SIGTERM mid-run (or mid-sweep): the "interrupted ... rerun to resume" line, exit 130, Ray shut down (none of
    its processes left), no C++ stack dump or "Aborted"."""
    import signal
    import tempfile
    import time

    import psutil

    ray_tmp = tempfile.mkdtemp(prefix="oc", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    env = {**driver_env(tmp_path), "RAY_TMPDIR": ray_tmp}
    args = ["run", "--model", llama_path, "--tasks", "orchard_gen", "--include-path", tasks_dir, "--workers", "1",
            "--batch-size", "1", "--gen-kwargs", "max_gen_toks=400,until=QQQQ", "--output-path", tmp_path / "out"]  # fmt: skip
    if command == "sweep":
        args = ["sweep", _long_sweep(tmp_path, llama_path), "--workers", "1", "--output", tmp_path / "out"]
    proc = subprocess.Popen([sys.executable, "-m", "driver", *map(str, args)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        until(lambda: (tmp_path / "out" / "cache" / "results.sqlite").exists() or proc.poll() is not None, 300, 0.2)
        time.sleep(1.0)  # Ray is up and its worker is loading or generating
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:  # a hung run (the bug this test is for) must not outlive it, nor its Ray
        if proc.poll() is None:
            for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                p.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 130, err[-3000:]
    assert lines[-1].startswith(f"interrupted: finished requests are cached in {tmp_path / 'out' / 'cache'}"), err[-3000:]
    assert "SIGTERM received" not in err and "Aborted" not in err and "Traceback" not in err, err[-3000:]
    from testbed.waiting import until_empty

    left = until_empty(lambda: [p.pid for p in psutil.process_iter(["cmdline"]) if ray_tmp in " ".join(p.info["cmdline"] or ())])
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, f"Ray processes left running: {left}"


@pytest.mark.parametrize("bad, said", [("dashboard=flase", "not a boolean"), ("threads=x", "not a whole number"),
                                       ("max_restarts=-1", "too small"), ("group_size=0", "group_size=0: too small"),
                                       ("group_size=two", "not a whole number"),
                                       ("split=ring", "split=ring: unknown value")])  # fmt: skip
def test_mlx_rays_own_model_args_are_checked_before_ray_starts(stories_path, bad, said):
    # simple_evaluate(model="mlx-ray", model_args=...): a typo in a Ray-only key is one line, never a silent default
    import driver  # noqa: F401  registers the models
    from lm_eval.api.registry import get_model

    from driver.checks.settings import SettingError

    with pytest.raises(SettingError, match=said):
        get_model("mlx-ray").create_from_arg_string(f"pretrained={stories_path},{bad}", {})


@pytest.mark.usefixtures("ray_disconnected")
def test_a_split_the_model_cannot_take_is_a_value_error_before_ray_starts(stories_path):
    # simple_evaluate(model="mlx-ray", model_args="...,group_size=3,split=tensor"): the stories model's 8 heads
    import driver  # noqa: F401  registers the models
    import ray
    from lm_eval.api.registry import get_model

    args = f"pretrained={stories_path},workers=1,address=local,group_size=3,split=tensor"
    with pytest.raises(ValueError, match="the model's 8 attention heads do not divide by group size 3"):
        get_model("mlx-ray").create_from_arg_string(args, {})
    with pytest.raises(ValueError, match="group size 6 is larger than the model's 5 layers"):
        get_model("mlx-ray").create_from_arg_string(args.replace("3,split=tensor", "6,split=pipeline"), {})
    assert not ray.is_initialized()


def test_group_size_auto_is_the_fewest_nodes_whose_memory_holds_the_weights():
    from driver.checks.groups import share_fits, smallest_size, too_large

    assert [smallest_size(need, 64.0) for need in (0.001, 64.0, 64.1, 140.0, 400.0)] == [1, 1, 2, 3, 7]
    assert share_fits(140.0, 3, 48.0) and not share_fits(140.0, 2, 48.0)
    line = too_large(140.0, 48.0, 2, "the cluster's smallest node")
    assert "the model's weights (140.0 GB) do not fit in the 48.0 GB the cluster's smallest node has for models" in line and "holding a share of 1/2 (70.0 GB)" in line
    assert "pass --group-size 3 (or auto)" in line and "\n" not in line


def test_the_flags_reach_the_executor_as_a_grouping(stories_path):
    # what `driver run --group-size 2 --split tensor` hands mlx-ray, resolved on the head (no auto left)
    from worker.spec import Grouping, ModelSpec

    from driver.lm.mlx_ray import model_grouping

    spec = ModelSpec(model=str(stories_path))
    assert model_grouping(spec, 2, "tensor", "local") == Grouping(size=2, split="tensor")
    assert model_grouping(spec, 2, "auto", "local") == Grouping(size=2, split="pipeline")
    assert model_grouping(spec, "auto", "auto", "local") == Grouping(size=1, split="pipeline")
    assert model_grouping(spec, 1, "auto", None) == Grouping()


def _story_args(tmp_path, name: str, *extra: str) -> list:
    """`driver run`'s arguments for the stories model and its three tasks (8 documents each) on the embedded Ray,
    samples logged to tmp_path / name."""
    from testbed.stories import MODEL, TASKS, write_story_tasks

    tasks = write_story_tasks(tmp_path / "tasks")
    return ["run", "--model", MODEL, "--tasks", ",".join(TASKS), "--include-path", tasks, "--address", "local",
            "--workers", "1", "--threads", "1", "--batch-size", "8", "--limit", "8", "--log-samples",
            "--output-path", tmp_path / name, *extra]  # fmt: skip


def _story_samples(folder) -> dict:
    """{task: {doc_id: filtered responses}} of a stories run's logged samples."""
    import json

    from testbed.stories import TASKS

    samples = {t: {} for t in TASKS}
    for path in folder.rglob("samples_*.jsonl"):
        task = next(t for t in TASKS if path.name.startswith(f"samples_{t}_"))
        for line in path.read_text().splitlines():
            row = json.loads(line)
            samples[task][row["doc_id"]] = row["filtered_resps"]
    return samples


def _story_run(tmp_path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict, dict]:
    """`driver run` with `_story_args`: (the process, its samples, the run summary)."""
    import json

    proc = driver(tmp_path, *_story_args(tmp_path, name, *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(next((tmp_path / name).rglob("summary_*.json")).read_text())
    return proc, _story_samples(tmp_path / name), summary


def _close(a, b, tol: float) -> bool:
    """Responses equal: text exactly, numbers (lm-eval logs them as text) within `tol`, lists element by element."""
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    try:
        return abs(float(a) - float(b)) <= tol
    except (TypeError, ValueError):
        return a == b


@pytest.mark.slow
@pytest.mark.parametrize("split, tol", [("auto", 1e-5), ("tensor", 1e-4)])
def test_a_group_of_two_on_the_local_cluster_equals_the_unsplit_run(tmp_path, story_plain, split, tol):
    """`driver run --address local --workers 1 --group-size 2`: one group of two local processes (a ring over
    127.0.0.1) holding the stories model split (auto: pipeline, layers 0-2 | 3-4; tensor: 4 heads each) gives the
    unsplit run's numbers: every log-likelihood, rolling perplexity term and greedy generation."""
    proc, grouped, summary = _story_run(tmp_path, "grouped", "--group-size", "2", "--split", split)
    ranks = summary["worker_facts"][0]["ranks"]
    assert summary["workers"] == 1 and [r["rank_in_group"] for r in ranks] == [0, 1]  # the group really formed
    if split == "auto":
        assert [tuple(r["layers"]) for r in ranks] == [(0, 3), (3, 5)]
        assert "--split auto: pipeline (contiguous layers per node" in proc.stderr
    assert all(r["peak_memory_gb"] > 0 for r in ranks)
    assert {t: sorted(s) for t, s in grouped.items()} == {t: sorted(s) for t, s in story_plain.items()}
    different = [(t, d) for t in story_plain for d in story_plain[t] if not _close(story_plain[t][d], grouped[t][d], tol)]
    assert not different, [(t, d, story_plain[t][d], grouped[t][d]) for t, d in different[:3]]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_vectors_from_a_group_of_two_equal_the_unsplit_ones(tmp_path):
    """`driver vectors --group-size 2` (pipeline: layers 0-2 on rank 0, 3-4 on rank 1): every layer's vector,
    gathered from the rank that owns it, equals the unsplit worker's. (A cache each: a grouping shares its cache.)"""
    import json

    import numpy as np
    from safetensors.numpy import load_file

    from testbed.stories import MODEL

    pairs = tmp_path / "pairs.jsonl"
    lines = [("Lily was happy and smiled", "Lily was sad and cried"), ("The dog was glad to play", "The dog was upset to stay")]
    pairs.write_text("".join(json.dumps({"positive": p, "negative": n}) + "\n" for p, n in lines))
    found = {}
    for name, extra in (("plain", []), ("grouped", ["--group-size", "2"])):
        args = ["vectors", "--model", MODEL, "--pairs", pairs, "--out", tmp_path / f"{name}.safetensors", "--workers", "1",
                "--threads", "1", "--cache", tmp_path / name, *extra]  # fmt: skip
        # the unsplit reference in this process on the session's cluster; the group on the embedded Ray, as a user runs it
        proc = driver(tmp_path, *args, "--address", "local") if extra else in_process(tmp_path, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ("on 1 group of 2 on 1 node" if extra else "on 1 worker on 1 node") in proc.stdout, proc.stdout
        found[name] = load_file(str(tmp_path / f"{name}.safetensors"))
    assert sorted(found["plain"]) == sorted(found["grouped"]) and len(found["plain"]) == 5
    for key, vector in found["plain"].items():
        assert np.abs(vector - found["grouped"][key]).max() <= 1e-5, key


def test_a_model_too_large_for_a_node_names_the_group_size_that_would_fit(ray_cluster, llama_path):
    """The lone worker's "does not fit" refusal (cluster.actor.check_fits) names --group-size K: a node with 1 KB
    for models needs ceil(weights / 1 KB) of its kind to hold the tiny llama."""
    import math

    from cluster import WorkerActor
    from worker.load import weights_bytes

    from driver.lm.mlx_ray import MLXRayLM

    class TinyNode(WorkerActor):
        def memory_for_models(self) -> tuple[float, str]:
            return 1 / 2**20, "system memory"

    lm = type("TinyRayLM", (MLXRayLM,), {"actor_cls": TinyNode})(pretrained=str(llama_path), workers=1)
    try:
        with pytest.raises(ValueError) as e:
            lm.executor.wait_ready()
    finally:
        lm.executor.close()
    k = math.ceil(weights_bytes(llama_path) / 2**10)
    assert k > 1 and f"pass --group-size {k} (or auto) to split it across that many nodes" in str(e.value), str(e.value)


@pytest.mark.parametrize("flag", ["--output", "--output-path"])
def test_an_empty_output_folder_is_refused(llama_path, tasks_dir, flag):
    """lm-eval reads an empty output path as none: the results JSON would silently not be written."""
    line = run(2, "run", "--model", str(llama_path), "--include-path", str(tasks_dir), "--tasks", "orchard_mc", "--workers", "1", flag, "")
    assert line == "Error: --output is empty: give a folder (e.g. orchard-out)"
