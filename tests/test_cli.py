"""`driver` on bad input: a one-line error naming the problem, the exact exit code (2: the command line is wrong,
1: what it names is not usable), no traceback. No cluster needed. (tests/test_errors.py runs the full table as
real subprocesses; these run in process, and check the Python API's model_args and the cache file rules.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from driver.cli import main


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
    from driver import preflight

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(preflight, "writable_folder", broken)
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
    from driver.lm import MLXLM

    with pytest.raises(ValueError) as info:
        MLXLM(pretrained=str(llama_path), **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("content", [b"not a database at all" * 8, "sqlite-foreign"])
def test_the_cache_refuses_a_foreign_file_and_leaves_it_alone(tmp_path, content):
    import sqlite3

    from driver.cache import Cache

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
    from driver.cache import Cache

    cache = Cache(tmp_path)
    cache.put([(b"k", [1.0, True])])
    cache.close()
    again = Cache(tmp_path)
    assert again.get([b"k"]) == {b"k": [1.0, True]}
    again.close()


def test_settings_parsers_in_the_users_words():
    from driver import settings

    assert settings.limit("0.5") == 0.5 and settings.limit("10") == 10 and settings.limit("10.0") == 10
    assert settings.gen_kwargs("temperature=0.7,top_k=5,until=\\n") == {"temperature": 0.7, "top_k": 5, "until": "\\n"}
    assert settings.model_args("dtype=float16,prefix_reuse=false", flags={}) == {"dtype": "float16", "prefix_reuse": False}
    with pytest.raises(settings.SettingError, match=r"--model-args: dtype is given twice"):
        settings.model_args("dtype=float16,dtype=float32", flags={})


def test_run_summaries_say_where_the_results_came_from():
    from driver.evaluation import on_workers

    assert on_workers({"workers": 0, "nodes": 0, "address": None}) == "on no workers (every result came from the cache)"
    assert on_workers({"workers": 2, "nodes": 1, "address": "local"}, ray=True) == "on 2 workers on 1 node (Ray at local)"
    assert on_workers({"workers": 4, "nodes": 2, "address": "10.0.0.1:6379"}) == "on 4 workers on 2 nodes"
