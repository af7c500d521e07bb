"""A new user's first path on a fresh install: `pip install -e` of this checkout into a new venv WITHOUT the test
extras, then that venv's `driver`: `cluster up --nodes 2`, `stage` (twice: the second moves nothing), `run --stage`
on a tiny offline task against that cluster, `cluster down`, and then none of that cluster's processes remain.

Everything lives under one temp folder (HOME, ORCHARD_HOME, RAY_TMPDIR, the datasets cache): nothing touches the
real user's. pip's own cache is the outer one (PIP_CACHE_DIR), so a rerun installs from it. Takes minutes: `slow`.
A quick companion test reads the same promise off the source: every third-party module Orchard imports is a
declared dependency.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "driver", "worker", "testbed")  # everything a user's `driver` (and its demo) may import
ON_REQUEST = {"torch"}  # `driver steer convert` reads a .pt with the user's own torch, and says so where it is missing


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_modules() -> set[str]:
    """Top-level modules imported anywhere in Orchard's packages (inside functions too), not its own or stdlib."""
    import ast

    found = set()
    for path in (p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in PACKAGES and m not in ON_REQUEST}


def test_every_module_orchard_imports_is_a_declared_dependency():
    """Not merely brought by another package (psutil came only with the test extras, and Ray stopped bringing it)."""
    tomllib = pytest.importorskip("tomllib")
    from importlib.metadata import packages_distributions

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_canonical(Requirement(r).name) for r in project["dependencies"]}
    owners = packages_distributions()
    undeclared = {m: owners.get(m) for m in _imported_modules() if not {_canonical(d) for d in owners.get(m, [])} & declared}
    assert not undeclared, f"imported but not in pyproject.toml's dependencies (module: distributions): {undeclared}"


def test_every_package_folder_is_in_the_distribution():
    """A plain `pip install .` (a wheel) holds every folder of Orchard's code: a list of packages written by hand
    had left out worker.hooks and worker.grid, which only an editable install hid."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = pytest.importorskip("setuptools")

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = set(setuptools.find_namespace_packages(where=str(ROOT), include=find["include"]))  # pyproject's default
    folders = {".".join(p.parent.relative_to(ROOT).parts) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    assert folders <= shipped, f"not in the wheel: {sorted(folders - shipped)}"
    assert not {p for p in shipped if p.split(".")[0] not in PACKAGES}, shipped  # no tests, benches or examples


def test_every_data_file_of_the_code_is_in_the_distribution():
    """Files beside the code that it reads (the judge's rubric templates) are package data of a wheel too."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"].get("package-data", {})
    files = [f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*") if f.is_file() and f.suffix not in (".py", ".pyc")]

    def shipped(f: Path) -> bool:
        rel = f.relative_to(ROOT)
        return any(fnmatch.fnmatch(str(rel.relative_to(*key.split("."))), pattern)
                   for key, patterns in data.items() if rel.is_relative_to(Path(*key.split("."))) for pattern in patterns)  # fmt: skip

    assert files and not [str(f) for f in files if not shipped(f)]


def _pip_cache() -> str | None:
    proc = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def _env(base: Path, venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTEST_", "VIRTUAL_ENV", "PYTHON", "HF_", "ORCHARD"))}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), HOME=str(base / "home"),
        ORCHARD_HOME=str(base / "oh"), RAY_TMPDIR=str(base / "rt"), HF_HOME=str(base / "hf"), HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(base / "hf-datasets"), RAY_USAGE_STATS_ENABLED="0",
        TOKENIZERS_PARALLELISM="false",
    )  # fmt: skip
    cache = _pip_cache()
    if cache:
        env["PIP_CACHE_DIR"] = cache  # HOME moved: keep pip's cache where the outer pip has it
    return env


def _run(*argv: str | Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env, cwd=env["HOME"], timeout=timeout)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, f"{argv}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _ours(base: Path, marks: list[str]) -> list:
    """Processes started from this test's folder (the venv's python and Ray binaries) or naming the cluster."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "exe"]):
        line = " ".join(p.info["cmdline"] or []) + " " + (p.info["exe"] or "")
        if p.pid != os.getpid() and any(m in line for m in [str(base), *marks]):
            found.append(p)
    return found


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(procs: list) -> None:
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


@pytest.mark.slow
def test_a_fresh_install_runs_the_first_path_and_cluster_down_leaves_nothing(stories_path: Path, tasks_dir: Path):
    base = Path(tempfile.mkdtemp(prefix="ofresh", dir="/tmp"))  # short: Ray's socket paths must stay < 108 bytes
    venv, marks = base / "venv", []
    for sub in ("home", "rt"):
        (base / sub).mkdir()
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        env = _env(base, venv)
        _run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile", "-e", ROOT, env=env, timeout=1500)
        shown = _run(venv / "bin" / "python", "-m", "pip", "list", "--format=json", env=env).stdout
        assert "torch" not in {p["name"] for p in json.loads(shown)}  # no test extras: a user's install
        driver = venv / "bin" / "driver"

        up = _run(driver, "cluster", "up", "--nodes", "2", env=env).stdout
        state = json.loads((base / "oh" / "local-cluster" / "state.json").read_text())
        marks += [state["temp_dir"], f"={state['address']}"]
        exports = re.search(r"^  export (.+)$", up, re.M).group(1)
        env.update(pair.split("=", 1) for pair in exports.split())  # what the user pastes into the shell
        address = ["--address", state["address"]]

        first = _run(driver, "stage", "--model", stories_path, *address, env=env).stdout.strip().splitlines()
        assert len(first) == 3 and all(" sent 7 files (1.1 MB, " in line for line in first[:2]), first
        again = _run(driver, "stage", "--model", stories_path, *address, env=env).stdout.strip().splitlines()
        assert len(again) == 3 and all(" sent 0 files (0.0 MB, " in line and line.endswith("kept 7") for line in again[:2]), again
        assert first[-1].rsplit(" as ", 1)[1] == again[-1].rsplit(" as ", 1)[1]  # the same staged:<id>

        run = _run(
            driver, "run", "--model", stories_path, "--tasks", "orchard_mc", "--include-path", tasks_dir, "--limit", "3",
            "--workers", "2", "--threads", "1", "--stage", *address, "--output-path", base / "out", env=env,
        )  # fmt: skip
        assert "orchard_mc" in run.stdout and "staged " in run.stderr, run.stdout + run.stderr
        assert list((base / "out").rglob("results_*.json"))

        down = _run(driver, "cluster", "down", env=env).stdout
        assert f"stopped the local cluster at {state['address']}" in down
        left = [p for p in _ours(base, marks) if _alive(p)]
        assert not left, [" ".join(p.cmdline()) for p in left]
        assert not Path(state["temp_dir"]).exists()
    finally:
        _kill(_ours(base, marks))
        for folder in [base, *(Path(m) for m in marks[:1])]:
            shutil.rmtree(folder, ignore_errors=True)
