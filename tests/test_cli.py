"""`driver` on bad input: a one-line error naming the problem, a non-zero exit, no traceback. No cluster needed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from driver.cli import main


def run(*args: str):
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code in (1, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.fixture
def common(llama_path, tasks_dir, tmp_path):
    return ["--model", str(llama_path), "--include-path", str(tasks_dir), "--output-path", str(tmp_path)]


def test_unknown_task(common):
    assert "unknown task no_such_task" in run("run", *common, "--tasks", "no_such_task", "--workers", "1")


def test_missing_model(common, tmp_path):
    common[1] = str(tmp_path / "absent")
    assert "model path does not exist" in run("run", *common, "--tasks", "orchard_mc", "--workers", "1")


def test_unreachable_address(common):
    error = run("run", *common, "--tasks", "orchard_mc", "--workers", "1", "--address", "127.0.0.1:1")
    assert "cannot reach a Ray cluster at 127.0.0.1:1" in error


@pytest.mark.parametrize(
    "workers, message", [("0", "--workers 0: at least 1 worker is needed"), ("many", "--workers 'many' is not a number")]
)
def test_bad_worker_count(common, workers, message):
    assert message in run("run", *common, "--tasks", "orchard_mc", "--workers", workers)


def test_real_entry_point_exits_non_zero_without_traceback(llama_path):
    proc = subprocess.run(
        [sys.executable, "-m", "driver", "run", "--model", str(llama_path), "--tasks", "x", "--workers", "0"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Error: --workers 0: at least 1 worker is needed" in proc.stderr and "Traceback" not in proc.stderr


def test_every_command_has_help():
    for command in ([], ["run"], ["demo"], ["nodes"]):
        result = CliRunner().invoke(main, [*command, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output
    assert "--num-fewshot" in CliRunner().invoke(main, ["run", "--help"]).output
