"""What a user sees while a command works: one `driver:` line per phase on stderr from the start (Ray, the model
loading), nothing of it on stdout (results only), `--quiet` silencing it, `driver --version`, and a fast start
(`driver --help` imports neither MLX nor lm-eval's model code)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from driver.cli import main


def invoke(*args: str):
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


@pytest.fixture(scope="module")
def mc_run(ray_cluster, llama_path, tasks_dir, tmp_path_factory):
    def go(*extra: str):
        out = tmp_path_factory.mktemp("phases")
        return invoke(
            "run", "--model", str(llama_path), "--include-path", str(tasks_dir), "--tasks", "orchard_mc", "--limit", "4",
            "--workers", "2", "--address", ray_cluster.address, "--output-path", str(out), *extra,
        )  # fmt: skip

    return go


def test_a_run_tells_its_phases_on_stderr_and_keeps_stdout_for_results(mc_run, ray_cluster, llama_path):
    result = mc_run()
    assert result.exit_code == 0, result.output
    phases = [line for line in result.stderr.splitlines() if line.startswith("driver: ")]
    assert phases[0] == f"driver: opening {llama_path} on this machine (MLX, its tokenizer and its files' fingerprints)"
    # this process is joined to the session's cluster already (a new process says "joining the Ray cluster at ...")
    assert phases[1] == f"driver: using the Ray cluster this process is connected to, at {ray_cluster.address}: 2 workers", result.stderr
    assert phases[2] == f"driver: loading {llama_path} on 2 workers (lm-eval builds its requests meanwhile)"
    assert "driver:" not in result.stdout
    assert "orchard_mc" in result.stdout  # lm-eval's table: a result


def test_quiet_leaves_results_and_nothing_else(mc_run):
    result = mc_run("--quiet")
    assert result.exit_code == 0, result.output
    assert "driver:" not in result.stderr and "req/s" not in result.stderr, result.stderr  # no phases, no bar
    assert "orchard_mc" in result.stdout
    again = invoke("--help")  # an earlier in-process --quiet does not carry over
    assert again.exit_code == 0


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout.startswith("driver (Orchard) ")


def test_the_command_line_starts_without_mlx_or_lm_eval_models():
    code = "import sys, driver.cli; print(sorted(m for m in ('mlx.core', 'mlx_lm', 'driver.lm.mlx', 'ray', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_lm_eval_still_finds_both_models_by_name():
    from lm_eval.api.registry import get_model

    import driver  # noqa: F401

    assert get_model("mlx").__name__ == "MLXLM"
    assert get_model("mlx-ray").__name__ == "MLXRayLM"


def test_a_refusal_before_ray_is_one_line_and_nothing_else(llama_path, tasks_dir, tmp_path):
    """The phase lines start only once the checks before Ray pass: a refusal there is the whole of stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "driver", "run", "--model", str(llama_path), "--include-path", str(tasks_dir), "--tasks",
         "orchard_mc", "--workers", "1", "--address", "127.0.0.1:1", "--output-path", str(tmp_path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("Error: cannot reach a Ray cluster at 127.0.0.1:1"), proc.stderr


def test_a_refusal_after_ray_started_follows_its_phases_and_is_the_one_error(ray_cluster, llama_path, tasks_dir, tmp_path):
    result = invoke(
        "run", "--model", str(llama_path), "--include-path", str(tasks_dir), "--tasks", "orchard_mc", "--workers", "5",
        "--address", ray_cluster.address, "--output-path", str(tmp_path),
    )  # fmt: skip
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[1].startswith("driver: using the Ray cluster this process is connected to, at") and lines[-1].startswith("Error: --workers 5 needs 5")
    assert sum(line.startswith("Error:") for line in lines) == 1 and "driver:" not in result.stdout


@pytest.mark.parametrize("quiet", ["0", "1"])
def test_what_auto_chose_is_said_unless_quiet(monkeypatch, capsys, quiet):
    from driver.checks.groups import tell_chosen
    from worker.spec import Grouping

    monkeypatch.setenv("ORCHARD_QUIET", quiet)
    tell_chosen("auto", "auto", Grouping(size=2, split="pipeline"))
    said = capsys.readouterr()
    assert said.out == ""  # never on stdout: results only
    if quiet == "1":
        assert said.err == ""
    else:
        assert said.err.startswith("driver: --group-size auto: 2 (") and "\ndriver: --split auto: pipeline (" in said.err, said.err
