"""Issue 38's user-facing loose ends: a grouped demo that computes, Ctrl-C answered at once (before Ray, while it
starts, a second one too) naming only folders that exist, one bar per phase, a fast and visible pre-flight (lm-eval
indexes only the named tasks' folders), `driver:` on every phase line, the embedded Ray's session folder removed and
its token said, the demo's tasks in the driver's own module."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from driver.cli import main


def test_a_grouped_demo_has_its_own_folder_and_a_cached_grouping_is_said(capsys):
    from driver.cli.demo import default_folder
    from driver.cli.run import tell_cached
    from worker.spec import Grouping

    folders = {default_folder(1, "auto"), default_folder(2, "auto"), default_folder(2, "tensor"), default_folder("auto", "auto")}
    assert len(folders) == 4 and default_folder(1, "auto") == "orchard-out/demo"
    assert default_folder(2, "pipeline") == default_folder(2, "auto")  # auto is pipeline: the same numbers, the same cache
    tell_cached({"workers": 0}, Grouping(size=2, split="pipeline"), "out/cache")
    tell_cached({"workers": 2}, Grouping(size=2, split="pipeline"), "out/cache")  # computed on groups: nothing to say
    tell_cached({"workers": 0}, Grouping(), "out/cache")  # no grouping asked for
    said = capsys.readouterr()
    assert said.out == "" and said.err.count("\n") == 1
    assert said.err.startswith("driver: every request was answered from the result cache out/cache: no group of 2 formed")


def test_ctrl_c_before_ray_says_interrupted_and_exits_130(monkeypatch, tmp_path, stories_path, tasks_dir):
    import driver.cli.run as run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "check_workers", interrupted)  # the first check before Ray
    result = CliRunner().invoke(main, ["run", "--model", str(stories_path), "--tasks", "orchard_mc", "--include-path",
                                       str(tasks_dir), "--output", str(tmp_path / "out")], standalone_mode=True)  # fmt: skip
    assert result.exit_code == 130 and result.stderr.strip() == "interrupted", result.stderr
    assert "Aborted" not in result.output


def test_an_interrupt_names_the_cache_only_when_it_exists(tmp_path, capsys):
    from driver.cli.errors import resumable

    for cache, says in ((tmp_path / "none", "interrupted: nothing was computed yet"),
                        (tmp_path / "held", f"interrupted: finished requests are cached in {tmp_path / 'held'}")):  # fmt: skip
        if cache.name == "held":
            cache.mkdir()
            (cache / "results.sqlite").write_bytes(b"")
        with pytest.raises(SystemExit) as e, resumable(cache):
            raise KeyboardInterrupt
        assert e.value.code == 130 and capsys.readouterr().err.startswith(says)
    assert not (tmp_path / "none").exists()


def test_phase_lines_start_with_driver_and_vectors_builds_no_lm_eval_requests(capsys, monkeypatch):
    from driver.checks.groups import tell
    from driver.lm.quiet import doing_meanwhile, meanwhile

    monkeypatch.delenv("ORCHARD_QUIET", raising=False)
    tell(["--split auto: pipeline (contiguous layers per node)"])
    assert capsys.readouterr().err == "driver: --split auto: pipeline (contiguous layers per node)\n"
    assert meanwhile() == " (lm-eval builds its requests meanwhile)"
    with doing_meanwhile(None):
        assert meanwhile() == ""
    import inspect

    import driver.cli.vectors

    assert "doing_meanwhile(None)" in inspect.getsource(driver.cli.vectors.vectors.callback)


def test_a_check_off_a_terminal_is_said_once_it_passed_and_a_refusal_stays_alone(capsys, monkeypatch):
    from driver.lm.quiet import phase

    monkeypatch.delenv("ORCHARD_QUIET", raising=False)
    with phase("checking s.yaml", after=0.01, transient=True):
        time.sleep(0.05)
    err = capsys.readouterr().err
    assert err.startswith("driver: checking s.yaml (") and err.endswith(" s)\n"), err
    with pytest.raises(ValueError), phase("checking s.yaml", after=0.01, transient=True):
        time.sleep(0.05)
        raise ValueError("refused")
    assert capsys.readouterr().err == ""


def test_finished_bars_end_before_the_next_phase_line_and_lm_evals_are_cleared(capsys, monkeypatch):
    import lm_eval.api.task as task

    from driver.lm.progress import Progress
    from driver.lm.quiet import quiet_lm_eval, say

    monkeypatch.delenv("ORCHARD_QUIET", raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    bar = Progress(["w0@vm"])
    bar.expect(4, 0, "loglikelihood")
    bar.advance(0, 4)
    say("sweep: the grid")  # the finished bar ends above this line, not drawn again below it
    assert bar.bar is None
    err = capsys.readouterr().err
    assert err.index("loglikelihood on 1 worker") < err.index("driver: sweep: the grid"), err
    assert "loglikelihood on 1 worker" not in err[err.index("driver: sweep: the grid"):]
    import io

    import tqdm.std

    from driver.lm import quiet

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # on a terminal
    init = tqdm.std.tqdm.__init__
    quiet._cleared_when_done()
    try:
        quiet_lm_eval()
        contexts = task.tqdm(total=1, file=io.StringIO())  # what lm-eval's build_all_requests makes, labelled
        tokenizing, ours = (tqdm.std.tqdm(total=1, desc=d, file=io.StringIO()) for d in ("Tokenizing", "loglikelihood on 1 worker"))
        assert (contexts.leave, tokenizing.leave, ours.leave) == (False, False, True)  # lm-eval's passes cleared once done
    finally:
        tqdm.std.tqdm.__init__ = init
        del tqdm.std.tqdm._orchard_cleared


def test_lm_eval_indexes_only_the_named_tasks_folders():
    import lm_eval.tasks

    from driver.checks.tasks import task_folders, task_manager

    root = Path(lm_eval.tasks.__file__).parent
    folders = task_folders(["openllm"], None)  # a group whose members live in six other folders
    assert folders and all(Path(f) != root and root in Path(f).parents for f in folders)
    manager = task_manager(["openllm"], None)
    index = manager._index
    assert len(index) < 500  # lm-eval's own: 14,000 entries
    todo, seen = ["openllm"], set()
    while todo:  # every member the group lists, and theirs, is in the index (lm-eval's own reading of each group)
        name = todo.pop()
        assert name in index, name
        entry = index[name]
        seen.add(name)
        if entry.kind.name == "GROUP":
            members = [m if isinstance(m, str) else m.get("task") for m in entry.cfg["task"]]
            todo += [m for m in members if isinstance(m, str) and m not in seen]
    assert len(seen) > 6


def test_the_demos_own_tasks_skip_lm_evals_index(monkeypatch, tmp_path):
    import driver.checks.tasks as tasks
    from driver.demo import TASKS, write_story_tasks

    folder = write_story_tasks(tmp_path / "tasks")
    monkeypatch.setattr(tasks, "default_task_names", lambda: pytest.fail("lm-eval's index read for the folder's own tasks"))
    assert tasks.check_tasks(",".join(TASKS), str(folder)) == list(TASKS)


def test_the_demo_tasks_live_in_the_driver():
    import inspect

    import driver.cli.demo
    import driver.demo
    import testbed.stories

    assert testbed.stories.write_story_tasks is driver.demo.write_story_tasks  # tests still find them in testbed
    assert "testbed" not in inspect.getsource(driver.cli.demo) and (driver.demo.MODEL / "config.json").is_file()


def _ray_pids(tmp: Path) -> list[int]:
    """The processes whose command line names `tmp` (this test's Ray temp folder)."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and str(tmp) in (p / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                out.append(int(p.name))
        except OSError:
            continue
    return out


SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    from pathlib import Path
    from driver.lm import quiet
    quiet.install()  # the CLI's handlers
    from cluster.connect import connect

    connect("local", local_workers=1).close()  # a whole run: its session folder goes with it
    sessions = sorted(p.name for p in (Path(os.environ["RAY_TMPDIR"]) / "ray").glob("session_2*"))
    print("sessions after a run:", sessions, flush=True)

    def interrupt_once_ray_starts():  # its raylet started: the rest of ray.init comes next
        while not list((Path(os.environ["RAY_TMPDIR"]) / "ray").glob("session_2*/logs/raylet.out")):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C too

    threading.Thread(target=interrupt_once_ray_starts, daemon=True).start()
    connect("local", local_workers=1)
    print("ray.init finished: not interrupted", flush=True)
""")


def test_ctrl_c_while_ray_starts_ends_at_once_and_leaves_no_session(tmp_path):
    from testbed.waiting import until_empty

    tmp = Path(f"/tmp/orchard-ux4-{os.getpid()}")  # short: Ray's socket paths must stay under 107 bytes
    tmp.mkdir(exist_ok=True)
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "RAY_TMPDIR": str(tmp), "HOME": str(home),
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), *sys.path]))}  # fmt: skip
    env = {k: v for k, v in env.items() if not k.startswith(("RAY_ADDRESS", "PYTEST_", "RAY_AUTH"))}
    try:
        proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=240)
        assert proc.returncode == 130, proc.stdout + proc.stderr
        assert "sessions after a run: []" in proc.stdout and "not interrupted" not in proc.stdout, proc.stdout + proc.stderr
        assert "interrupted while Ray was starting" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.count("driver: Ray created ~/.ray/auth_token") == 1, proc.stderr  # said once: the first time
        assert until_empty(lambda: _ray_pids(tmp)) == []
        assert list((tmp / "ray").glob("session_2*")) == []  # the interrupted start's folder too
    finally:  # a failed run's leftovers: this test's own processes, found by its own folder, killed by id
        for pid in _ray_pids(tmp):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
