"""Every command says what it does from its first seconds (issue 27.1), the ones that start no model too:
`driver cluster up/status/down` and `driver vectors`' checks before Ray; Ray that cannot start on this machine is
one line saying why; `--help` shows one name per option, the other spellings still accepted (27.6); a lost
worker is listed in the summary with why it has no requests (27.3)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from driver.cli import main
from testbed.inproc import driver


def _env(tmp_path: Path) -> dict:
    return {"ORCHARD_HOME": str(tmp_path / "oh"), "RAY_AUTH_MODE": None, "RAY_AUTH_TOKEN": None, "RAY_AUTH_TOKEN_PATH": None}


def test_cluster_up_status_and_down_say_what_they_do_on_stderr(tmp_path):
    env = _env(tmp_path)
    up = driver("cluster", "up", "--nodes", "1", cwd=tmp_path, env=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert up.stderr.splitlines()[0] == (
            "driver: starting 1 Ray node on 127.0.0.1, one at a time (token authentication, one `mlx` unit each)")
        assert up.stdout.startswith("Local Ray cluster: 1 node on 127.0.0.1") and "driver:" not in up.stdout
        address = up.stdout.splitlines()[1].removeprefix("address: ")
        exported = driver("cluster", "status", "--env", cwd=tmp_path, env=env)
        assert exported.stderr == "" and exported.stdout.startswith(f"export RAY_ADDRESS={address} ")
    finally:
        down = driver("cluster", "down", cwd=tmp_path, env=env)
    assert down.stderr.splitlines() == [f"driver: stopping the local cluster at {address} (its processes only)"]
    assert down.stdout == f"stopped the local cluster at {address}\n"
    again = driver("cluster", "down", cwd=tmp_path, env=env)
    assert (again.stdout, again.stderr) == ("no local cluster is running (nothing to stop)\n", "")


@pytest.fixture
def screen(monkeypatch):
    """What a terminal on stderr would show of the phases (driver.lm.quiet asked for its terminal gets this one);
    CliRunner's own stderr is what a log or a pipe gets."""
    from driver.lm import quiet

    shown = io.StringIO()
    monkeypatch.setattr(quiet, "_terminal", lambda: shown)
    monkeypatch.setenv("COLUMNS", "1000")
    monkeypatch.delenv("ORCHARD_QUIET", raising=False)
    return shown


def test_vectors_says_so_on_a_terminal_while_its_checks_before_ray_take_seconds(stories_path, tmp_path, monkeypatch, screen):
    """The model's sites (mlx-lm's classes) and the pairs tokenized (mlx-lm imports transformers) take seconds on
    a first call: a terminal shows what runs, erased when it ends; stderr keeps the refusal alone (here --position
    0, BOS on both sides). The tokenizer is made slow on purpose: the subject is the line, not the time."""
    from driver.steering import vectors as vec

    encoder = vec.head_encoder
    monkeypatch.setattr(vec, "head_encoder", lambda *a: (time.sleep(1.5), encoder(*a))[1])
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"positive": "Lily was happy", "negative": "Lily was sad"}) + "\n")
    result = CliRunner().invoke(main, ["vectors", "--model", str(stories_path), "--pairs", str(pairs), "--out",
                                       str(tmp_path / "v.safetensors"), "--position", "0", "--address", "127.0.0.1:1"])  # fmt: skip
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"Error: {pairs}: the positive and negative texts of every pair agree on every token")
    shown = screen.getvalue()  # the line (its spinner turning after 2 s), erased at the end
    assert shown.startswith(f"driver: checking {stories_path}'s layers and tokenizing the pairs") and shown.endswith("\r\x1b[K")


def test_run_and_sweep_say_so_on_a_terminal_while_their_files_take_seconds_to_check(llama_path, tasks_dir, tmp_path,
                                                                                      monkeypatch, screen):  # fmt: skip
    """A steering spec and a sweep file are checked against the model's layers (mlx-lm's classes: seconds on a first
    call) before Ray: a terminal shows it while it lasts. The checks are made slow on purpose."""
    import driver.cli.run as run_command
    import driver.sweep

    monkeypatch.setattr(run_command, "check_steering", lambda *a: time.sleep(1.5))
    slow = driver.sweep.load_sweep
    monkeypatch.setattr(driver.sweep, "load_sweep", lambda *a: (time.sleep(1.5), slow(*a))[1])
    (tmp_path / "s.yaml").write_text("interventions: []\n")
    result = CliRunner().invoke(main, ["run", "--model", str(llama_path), "--include-path", str(tasks_dir), "--tasks", "orchard_mc",
                                       "--steer", str(tmp_path / "s.yaml"), "--address", "127.0.0.1:1", "--output", str(tmp_path)])  # fmt: skip
    assert result.exit_code == 1 and result.stderr.startswith("Error: cannot reach a Ray cluster at 127.0.0.1:1"), result.stderr
    shown = screen.getvalue()
    assert shown.startswith(f"driver: checking {tmp_path / 's.yaml'} against {llama_path}'s layers") and shown.endswith("\r\x1b[K")
    (tmp_path / "sweep.yaml").write_text("model: {pretrained: nowhere}\n")
    result = CliRunner().invoke(main, ["sweep", str(tmp_path / "sweep.yaml"), "--output", str(tmp_path / "o")])
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1 and result.stderr.startswith("Error: "), result.stderr
    shown = screen.getvalue()[len(shown):]
    assert shown.startswith(f"driver: checking {tmp_path / 'sweep.yaml'} against its model, vectors, tasks and prompts")
    assert shown.endswith("\r\x1b[K")


def test_ray_that_cannot_start_here_is_one_line_saying_why(tmp_path):
    """A RAY_TMPDIR so long that Ray's socket paths pass 107 bytes: ray.init fails; once an internal error."""
    folder = tmp_path / ("x" * 90)
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_TMPDIR": str(folder)}
    proc = subprocess.run([sys.executable, "-m", "driver", "nodes"], capture_output=True, text=True, env=env, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("driver: ")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    assert errors[0].startswith("Error: Ray could not start on this machine (") and "AF_UNIX path length" in errors[0]
    assert errors[0].endswith(f"set RAY_TMPDIR to a short folder such as /tmp (Ray's socket paths under {folder} pass 107 bytes)")
    assert "internal error" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("command, hidden", [("run", ["--output-path", "--output_path", "--num_fewshot", "--model_args"]),
                                             ("sweep", ["--output-path", "--output_path", "--group_size"]),
                                             ("vectors", ["--model_args", "--group_size"]),
                                             ("demo", ["--group_size"]), ("nodes", ["--group_size"])])  # fmt: skip
def test_help_shows_one_name_per_option(command, hidden):
    text = CliRunner().invoke(main, [command, "--help"]).stdout
    assert "--group-size" in text and "-q, --quiet" in text
    assert not [name for name in hidden if name in text], text
    if command in ("run", "sweep"):
        assert "  --output " in text  # the same name on both


@pytest.mark.parametrize("command", [["run", "--model", "m", "--tasks", "t"], ["sweep", "s.yaml"]])
@pytest.mark.parametrize("flag", ["--output", "--output-path", "--output_path"])
def test_every_spelling_of_the_output_flag_still_works(tmp_path, command, flag):
    (tmp_path / "f").write_text("")
    result = CliRunner().invoke(main, [*command, flag, str(tmp_path / "f")])
    assert result.exit_code == 1 and "No such option" not in result.output  # as every command refuses a file there
    assert "a file is in the way" in result.output, result.output


def test_a_lost_worker_is_listed_with_why_it_has_no_requests(capsys):
    from driver.lm.evaluation import _print_summary, per_worker

    info = {"names": ["w0@a", "w1@b", "w2@c"], "requests_computed": {"w0@a": 7, "w2@c": 3}, "lost": ["w1@b", "w2@c"],
            "requests_per_s": {"w0@a": 7.0, "w2@c": 3.0}}  # fmt: skip
    rows = per_worker(info)
    assert rows == {"w0@a": {"requests": 7, "requests_per_s": 7.0},
                    "w1@b": {"requests": 0, "requests_per_s": 0.0, "lost": True, "why_none": "lost before it finished a chunk"},
                    "w2@c": {"requests": 3, "requests_per_s": 3.0, "lost": True}}  # fmt: skip
    _print_summary({"requests": 10, "requests_cached": 0, "workers": 3, "nodes": 3, "address": "x", "wall_s": 1.0,
                    "per_worker": rows, "prefix_store": []})  # fmt: skip
    lines = capsys.readouterr().out.splitlines()[2:]
    assert [line.split()[0] for line in lines] == ["w0@a", "w1@b", "w2@c"]
    assert lines[1].endswith("(lost before it finished a chunk)") and lines[2].endswith("(lost)")


def test_a_group_run_says_groups_in_its_phases_and_its_bar(ray_cluster, llama_path, tasks_dir, tmp_path):
    """--group-size 2: the phase lines and Orchard's bar count groups (a bar once read 'loglikelihood on 2 workers')."""
    result = CliRunner().invoke(main, [
        "run", "--model", str(llama_path), "--include-path", str(tasks_dir), "--tasks", "orchard_mc", "--limit", "2",
        "--workers", "1", "--group-size", "2", "--address", ray_cluster.address, "--output", str(tmp_path)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"driver: loading {llama_path} on 1 group of 2 (lm-eval builds its requests meanwhile)" in result.stderr.splitlines()
    bars = [part for part in result.stderr.replace("\r", "\n").splitlines() if "req/s" in part and "Tokenizing" not in part]
    assert bars and all(part.startswith("loglikelihood on 1 group:") for part in bars), bars
    assert "on 1 group of 2 on 2 nodes" in result.stdout
