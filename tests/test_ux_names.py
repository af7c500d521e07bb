"""Names a user reads: a steered run says so above its table and writes its own results folder (the unsteered
run's is not shared); one folder-naming rule for `run` and `demo`; the same output flag on `run` and `sweep`;
`--workers`' default explained in every command's help."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from driver.cli import main
from driver.lm.evaluation import results_name
from test_steering_run import write_spec


def invoke(*args: str):
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result


def test_a_steered_run_says_so_and_keeps_its_own_folder(ray_cluster, llama_path, tasks_dir, tmp_path):
    spec = write_spec(tmp_path)
    common = ["run", "--model", str(llama_path), "--include-path", str(tasks_dir), "--tasks", "orchard_mc", "--limit", "1",
              "--workers", "1", "--address", ray_cluster.address, "--output", str(tmp_path / "out")]  # fmt: skip
    plain, steered = invoke(*common), invoke(*common, "--steer", spec)
    assert "steered by" not in plain.stdout
    (line,) = [x for x in steered.stdout.splitlines() if x.startswith("steered by")]
    assert line.startswith(f"steered by {Path(spec).absolute()} (key ")
    assert line.endswith(": L1 resid_post add α=3, L1 resid_pre clamp α=0.5 (prompt), L0 resid_post ablate (last)"), line
    assert steered.stdout.index(line) < steered.stdout.index("|orchard_mc")  # above the table it explains
    folders = sorted(p.parent.name for p in (tmp_path / "out").rglob("results_*.json"))
    assert len(folders) == 2 and folders[1] == folders[0] + "+steer-" + line.split("(key ")[1][:12], folders
    assert plain.stdout.splitlines()[-1] == f"results: {tmp_path / 'out' / folders[0]}"


def test_one_naming_rule_for_local_folders_and_hub_ids(tmp_path, monkeypatch):
    model = tmp_path / "examples" / "stories260K"
    model.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert results_name(str(model)) == results_name("examples/stories260K") == results_name("./examples/stories260K/") == "examples__stories260K"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert results_name(str(model)) == "stories260K"  # not below here: its own name
    monkeypatch.chdir(model)
    assert results_name(str(model)) == results_name(".") == "stories260K"
    assert results_name("mlx-community/Qwen2.5-0.5B-Instruct-4bit") == "mlx-community__Qwen2.5-0.5B-Instruct-4bit"
    assert results_name("org/m", {"key": "ab" * 32}) == "org__m+steer-abababababab"


def test_demo_names_its_paths_as_run_does():
    from driver.cli.demo import shown
    from testbed.stories import MODEL

    here = Path.cwd()
    os.chdir(MODEL.parents[1])
    try:
        assert shown(MODEL) == "examples/stories260K" and results_name(shown(MODEL)) == "examples__stories260K"
    finally:
        os.chdir(here)
    assert shown(Path("/")) == "/"


@pytest.mark.parametrize("command", ["run", "sweep", "vectors"])
def test_workers_help_says_what_all_means(command):
    text = " ".join(invoke(command, "--help").stdout.split())
    assert "or all: one per `mlx` node of the cluster" in text and "on the embedded Ray (no --address) all is 1" in text


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_the_output_flag_has_one_name_on_both_commands(command):
    """`--output` on both (`--output-path`/`--output_path` hidden aliases: tests/test_ux_commands.py)."""
    assert "  --output " in invoke(command, "--help").stdout
