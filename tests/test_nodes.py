"""`driver cluster up/down/status` and `driver nodes` against it: real `ray start` processes on 127.0.0.1 with token
authentication, driven through the CLI as a user would. Tests run in file order on one module-scoped cluster; the
fixture stops every cluster it started (by its processes), even when a test fails."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

NODES = 3


def _env(home: Path, **extra: str) -> dict[str, str]:
    """A user's shell: no Ray address or token variables, a HOME without ~/.ray, this test's ORCHARD_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "PYTEST_"))}
    env.update(HOME=str(home / "home"), ORCHARD_HOME=str(home / "oh"), RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    return {**env, **extra}


def driver(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    """`driver ...` from the user's home: not the repository, whose orchard.egg-info Ray's workers would see first
    (Ray puts the driver's working directory on their sys.path)."""
    return subprocess.run(
        [sys.executable, "-m", "driver", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=env["HOME"]
    )


def one_line_error(proc: subprocess.CompletedProcess, message: str) -> str:
    shown = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stdout + proc.stderr and proc.returncode == 1, shown
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("driver: ")]  # phases
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], shown
    return lines[0]


def _state(home: Path) -> dict | None:
    try:
        return json.loads((home / "oh" / "local-cluster" / "state.json").read_text())
    except (OSError, ValueError):
        return None


def _kill_leftovers(home: Path) -> None:
    """`driver cluster down`, then whatever of the recorded cluster still runs is killed by pid."""
    from cluster import local

    try:
        driver("cluster", "down", env=_env(home), timeout=120)
    finally:
        state = _state(home)
        if state:
            local._terminate(local.processes(state))
            shutil.rmtree(state["temp_dir"], ignore_errors=True)


class Up:
    def __init__(self, home: Path, proc: subprocess.CompletedProcess):
        self.home, self.proc = home, proc
        match = re.search(r"^address: (127\.0\.0\.1:\d+)$", proc.stdout, re.M)
        assert proc.returncode == 0 and match, proc.stdout + proc.stderr
        self.address = match.group(1)
        exports = re.search(r"^  export (.+)$", proc.stdout, re.M).group(1)
        self.auth = dict(pair.split("=", 1) for pair in exports.split())  # what the user pastes into the shell
        self.state = _state(home)


@pytest.fixture(scope="module")
def home():
    folder = Path(tempfile.mkdtemp(prefix="onodes", dir="/tmp"))  # short: Ray's socket paths must stay < 108 bytes
    (folder / "home").mkdir()
    try:
        yield folder
    finally:
        _kill_leftovers(folder)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def up(home: Path) -> Up:
    return Up(home, driver("cluster", "up", "--nodes", str(NODES), env=_env(home), timeout=300))


def _listening(pids: set[int]) -> list[str]:
    import psutil

    return [c.laddr.ip for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]


def test_up_prints_the_address_and_keeps_the_token_private(up: Up):
    from cluster import local

    token_file = Path(up.auth["RAY_AUTH_TOKEN_PATH"])
    assert up.auth["RAY_AUTH_MODE"] == "token" and token_file == up.home / "oh" / "local-cluster" / "auth_token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) == 64 and token not in up.proc.stdout + up.proc.stderr
    assert up.state["address"] == up.address and up.state["nodes"] == NODES
    pids = {p.pid for p in local.processes(up.state)}
    exposed = [ip for ip in _listening(pids) if ip.removeprefix("::ffff:") != "127.0.0.1"]
    assert pids and _listening(pids) and not exposed, f"the local cluster listens beyond loopback: {exposed}"


def test_nodes_json_lists_every_node_with_the_token(up: Up):
    proc = driver("nodes", "--address", up.address, "--json", env=_env(up.home, **up.auth))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    rows = report["nodes"]
    assert report["address"] == up.address and len(rows) == NODES and len({r["node_id"] for r in rows}) == NODES
    for r in rows:
        assert r["alive"] is True and r["mlx_units"] == 1 and r["address"] == "127.0.0.1"
        assert r["mlx_device"] in ("cpu", "gpu") and r["model_memory_gb"] > 0 and r["memory_gb"] > 0
        assert r["os"] and r["arch"] and r["python"] and r["blas"]
        assert all(r[key] for key in ("mlx", "mlx-lm", "lm_eval", "ray", "orchard"))
    assert not [w for w in report["warnings"] if "disagree" in w]


def test_nodes_shows_the_worker_groups_a_run_would_form(up: Up):
    """`--workers N --group-size K`: N groups of K distinct nodes (every node in at most one group), or one line
    naming how many nodes there are when they do not fit."""
    env = _env(up.home, **up.auth)
    proc = driver("nodes", "--address", up.address, "--group-size", "2", "--json", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    groups, ids = report["groups"], [r["node_id"] for r in report["nodes"]]
    assert len(groups) == NODES // 2 and all(len(g) == 2 and len(set(g)) == 2 and set(g) <= set(ids) for g in groups)
    proc = driver("nodes", "--address", up.address, "--workers", "1", "--group-size", str(NODES), env=env)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[NODES] == f"1 group of {NODES} (one node per rank; Ray picks which):", proc.stdout
    assert re.fullmatch(r"  group 0: " + ", ".join(rf"rank {r} \S+ \([0-9a-f]{{12}}\)" for r in range(NODES)), lines[NODES + 1])
    assert len(set(re.findall(r"\(([0-9a-f]{12})\)", lines[NODES + 1]))) == NODES  # distinct nodes
    one_line_error(driver("nodes", "--address", up.address, "--group-size", str(NODES + 1), env=env),
                   f"--group-size {NODES + 1} needs {NODES + 1} `mlx` nodes but the cluster has {NODES}")  # fmt: skip
    one_line_error(driver("nodes", "--address", up.address, "--workers", "2", "--group-size", "2", env=env),
                   f"--workers 2 --group-size 2 needs 4 `mlx` nodes but the cluster has {NODES}")  # fmt: skip


def test_group_size_auto_asks_the_clusters_nodes_before_any_model_loads(up: Up, stories_path: Path, tmp_path: Path):
    """--group-size auto on a cluster: its nodes' memory for models (no model loaded) against the weights; the
    1 MB stories model fits one node, said once the run starts, and the vectors come out."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"positive": "Lily was happy", "negative": "Lily was sad"}) + "\n")
    proc = driver("vectors", "--model", str(stories_path), "--pairs", str(pairs), "--out", str(tmp_path / "v.safetensors"),
                  "--address", up.address, "--workers", "1", "--group-size", "auto", env=_env(up.home, **up.auth))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--group-size auto: 1 (the fewest nodes whose memory for models holds the model's weights)" in proc.stderr
    assert (tmp_path / "v.safetensors").is_file()


def test_nodes_without_the_token_or_with_a_wrong_one_names_the_token_file_up_wrote(up: Up):
    """Not ~/.ray/auth_token (which any embedded `ray.init` leaves behind): the file `cluster up` wrote."""
    ours = up.auth["RAY_AUTH_TOKEN_PATH"]
    fix = f"set RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={ours} (`eval \"$(driver cluster status --env)\"` sets them)"
    default = up.home / "home" / ".ray" / "auth_token"
    default.parent.mkdir(exist_ok=True)
    default.write_text("1" * 64)
    try:
        for address in (up.address, up.address.replace("127.0.0.1", "localhost")):
            line = one_line_error(driver("nodes", "--address", address, env=_env(up.home)), f"the Ray cluster at {address} requires token")
            assert "it is the local cluster `driver cluster up` started" in line and line.endswith(fix) and "~/.ray" not in line
        line = one_line_error(driver("nodes", "--address", up.address, env=_env(up.home, RAY_AUTH_MODE="token")), fix)
        assert f"rejects the token from ~/.ray/auth_token: it is the local cluster" in line
    finally:
        default.unlink()
    wrong = up.home / "wrong"
    wrong.write_text("0" * 64)
    proc = driver("nodes", "--address", up.address, env=_env(up.home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(wrong)))
    one_line_error(proc, f"rejects the token from RAY_AUTH_TOKEN_PATH={wrong}: it is the local cluster")


def test_nothing_listening_is_one_line(up: Up):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = driver("nodes", "--address", f"127.0.0.1:{port}", env=_env(up.home, **up.auth))
    one_line_error(proc, f"cannot reach a Ray cluster at 127.0.0.1:{port}")


def test_status_and_a_second_up(up: Up):
    proc = driver("cluster", "status", env=_env(up.home))
    assert proc.returncode == 0 and f"address: {up.address}" in proc.stdout and f"{NODES} nodes" in proc.stdout, proc.stderr
    proc = driver("cluster", "status", "--env", env=_env(up.home))
    assert proc.returncode == 0 and proc.stdout.startswith(f"export RAY_ADDRESS={up.address} RAY_AUTH_MODE=token ")
    proc = driver("cluster", "up", "--nodes", "2", env=_env(up.home))
    one_line_error(proc, f"a local cluster is already running at {up.address} ({NODES} nodes)")


def _fresh_copy(model: Path, folder: Path) -> Path:
    """The model with one config changed: another content id, so nothing of it is staged yet."""
    shutil.copytree(model, folder)
    (folder / "generation_config.json").write_text(json.dumps({"copy": folder.name}))
    return folder


def _assert_staged(home: Path, model: Path) -> Path:
    from worker.staged import content_id, manifest, staged_path

    folder = staged_path(content_id(manifest(model)), root=home / "oh" / "models")
    for e in manifest(model):
        assert (folder / e["path"]).read_bytes() == (model / e["path"]).read_bytes()
    return folder


def test_two_stagings_at_once_into_the_store_every_node_shares(up: Up, stories_path: Path):
    """The cluster's nodes share one store (one machine, one ORCHARD_HOME): two `driver stage` runs at once are
    2 x NODES writers of the same files; both succeed, and a third run moves nothing."""
    model = _fresh_copy(stories_path, up.home / "stories-twice")
    argv = [sys.executable, "-m", "driver", "stage", "--model", str(model), "--address", up.address]
    env = _env(up.home, **up.auth)
    runs = [subprocess.Popen(argv, env=env, cwd=env["HOME"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [r.communicate(timeout=240) for r in runs]
    for r, (out, err) in zip(runs, outputs):
        assert r.returncode == 0 and "Traceback" not in err and "Error" not in err, out + err
        assert out.strip().splitlines()[-1].startswith(f"staged stories-twice (7 files, 1.1 MB) on {NODES} nodes")
    folder = _assert_staged(up.home, model)
    assert not list((folder / ".orchard").rglob("*.tmp")) and not list((folder / ".orchard" / "partial").rglob("*"))
    again = driver("stage", "--model", str(model), "--address", up.address, env=env)
    lines = again.stdout.strip().splitlines()
    assert again.returncode == 0 and len(lines) == NODES + 1, again.stdout + again.stderr
    assert all(" sent 0 files (0.0 MB, " in line and line.endswith("kept 7") for line in lines[:-1]), again.stdout


def test_run_with_stage_on_the_local_cluster(up: Up, stories_path: Path, tasks_dir: Path):
    model = _fresh_copy(stories_path, up.home / "stories-run")
    proc = driver(
        "run", "--model", str(model), "--tasks", "orchard_mc", "--include-path", str(tasks_dir), "--limit", "3",
        "--workers", "2", "--threads", "1", "--stage", "--address", up.address, "--output-path", str(up.home / "run-out"),
        env=_env(up.home, **up.auth),
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"staged {model} on {NODES} nodes" in proc.stderr and "orchard_mc" in proc.stdout
    assert f"2 workers, staging {model} on every node" in proc.stderr  # the phase says what the wait is for
    _assert_staged(up.home, model)


def test_a_staging_failure_in_run_is_one_line(up: Up, stories_path: Path, tasks_dir: Path):
    """A node that cannot write its copy (here: a file where the staged folder goes) fails `run --stage` in one line."""
    from worker.staged import content_id, folder_for, manifest

    model = _fresh_copy(stories_path, up.home / "stories-blocked")
    blocker = folder_for(model.name, content_id(manifest(model)), root=up.home / "oh" / "models")
    blocker.write_text("in the way")
    proc = driver(
        "run", "--model", str(model), "--tasks", "orchard_mc", "--include-path", str(tasks_dir), "--limit", "3",
        "--workers", "1", "--stage", "--address", up.address, "--output-path", str(up.home / "blocked-out"),
        env=_env(up.home, **up.auth),
    )  # fmt: skip
    line = one_line_error(proc, f"Error: {socket.gethostname()} (")
    assert "Not a directory" in line and str(blocker) in line and "internal error" not in line
    assert "Unhandled error" not in proc.stdout + proc.stderr


def test_a_node_with_another_orchard_version_lists_it_and_fails_in_one_line(up: Up, monkeypatch):
    """One more real node whose Python finds another Orchard's metadata first (as a Mac with another install would)."""
    from cluster import local

    monkeypatch.setenv("ORCHARD_HOME", str(up.home / "oh"))
    other = up.home / "other-orchard"
    (other / "orchard-9.9.9.dist-info").mkdir(parents=True)
    (other / "orchard-9.9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: orchard\nVersion: 9.9.9\n")
    local.join(up.state, env={"PYTHONPATH": str(other)})
    proc = driver("nodes", "--address", up.address, env=_env(up.home, **up.auth))
    assert "Traceback" not in proc.stderr and proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == NODES + 1 and all("mlx units 1" in line and line.endswith("alive") for line in lines), proc.stdout
    assert sum("orchard 9.9.9" in line for line in lines) == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and errors[0] == proc.stderr.strip().splitlines()[-1], proc.stderr
    assert errors[0].startswith("Error: nodes disagree on orchard (0.1.0 on") and "9.9.9 on" in errors[0]
    assert errors[0].endswith("install the same orchard on every Mac")


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _names(p, *marks: str) -> bool:
    line = " ".join(p.info["cmdline"] or [])
    return any(mark in line for mark in marks)


def test_down_stops_every_process_of_the_cluster(up: Up):
    import psutil

    from cluster import local

    procs = local.processes(up.state)
    assert len(procs) >= NODES
    proc = driver("cluster", "down", env=_env(up.home))
    assert proc.returncode == 0 and f"stopped the local cluster at {up.address}" in proc.stdout, proc.stderr
    time.sleep(0.5)
    left = [p for p in procs if _running(p)]
    assert not left and not local.processes(up.state), left
    # Listed independently of `local.processes`: nothing names the cluster's folder or address any more (Ray's
    # client server, `ray.util.client.server --address=127.0.0.1:PORT`, names only the address).
    named = [p for p in psutil.process_iter(["cmdline"]) if _names(p, up.state["temp_dir"], f"={up.address}")]
    assert not [p.info["cmdline"] for p in named if _running(p)]
    assert _state(up.home) is None and not Path(up.state["temp_dir"]).exists()
    assert Path(up.auth["RAY_AUTH_TOKEN_PATH"]).exists()  # made once: the next `up` uses the same token
    proc = driver("cluster", "down", env=_env(up.home))
    assert proc.returncode == 0 and "no local cluster is running" in proc.stdout
    one_line_error(driver("cluster", "status", env=_env(up.home)), "no local cluster is running")


def test_a_cluster_without_mlx_nodes_is_one_line(home: Path, monkeypatch):
    from cluster import local

    monkeypatch.setenv("ORCHARD_HOME", str(home / "oh"))
    state = local.up(1, mlx=0)
    try:
        env = _env(home, **local.driver_env(state))
        proc = driver("nodes", "--address", state["address"], env=env)
        line = one_line_error(proc, "no alive node offers the `mlx` resource (1 node without it)")
        assert "--resources" in line
    finally:
        local.down()


# --- how many workers this machine holds (--address local) ---------------------------------------------------------


def test_the_local_worker_limit_counts_cores_and_copies_of_the_weights():
    from cluster.limits import RAY_OVERHEAD, WORKER_OVERHEAD, WORKERS_PER_CORE, local_problem

    gb = 2**30
    assert local_problem(2 * WORKERS_PER_CORE, cores=2, available=64 * gb, weights=gb) is None
    line = local_problem(2 * WORKERS_PER_CORE + 1, cores=2, available=64 * gb, weights=gb)
    assert line.startswith(f"--workers {2 * WORKERS_PER_CORE + 1} with Ray on this machine (--address local): it has 2 CPU cores")
    assert f"pass --workers {2 * WORKERS_PER_CORE} or fewer" in line
    per = gb + WORKER_OVERHEAD  # 5 workers of a 1 GB model fit in exactly this much, 6 do not
    room = RAY_OVERHEAD + 5 * per
    assert local_problem(5, cores=8, available=room, weights=gb) is None
    line = local_problem(6, cores=8, available=room, weights=gb)
    assert "6 copies of the model (1.0 GB of weights each)" in line and "pass --workers 5 or fewer" in line
    assert "free memory" in local_problem(1, cores=8, available=RAY_OVERHEAD, weights=gb)
    # groups: N groups of K are N*K processes, each holding 1/K of the weights
    assert local_problem(2, cores=8, available=room, weights=2 * gb, size=2) is None  # 4 processes of 1 GB each
    assert "pass --workers 2 or fewer" in local_problem(3, cores=8, available=room, weights=2 * gb, size=2)
    line = local_problem(3, cores=2, available=64 * gb, weights=gb, size=3)
    assert line.startswith("--workers 3 --group-size 3 (9 worker processes) with Ray on this machine") and "pass --workers 2 or fewer" in line


def test_simple_evaluate_refuses_more_local_workers_than_this_machine_holds_before_ray_starts(stories_path: Path, tmp_path: Path):
    """lm-eval's own entry point (model_args workers=N), in a fresh process: refused before Ray is imported."""
    code = (
        "import sys, lm_eval, driver\n"
        "from cluster import ClusterError\n"
        "try:\n"
        f"    lm_eval.simple_evaluate(model='mlx-ray', model_args='pretrained={stories_path},workers=1000,address=local', tasks=['x'])\n"
        "except ClusterError as e:\n"
        "    print('refused:', e, '| ray started:', 'ray' in sys.modules and sys.modules['ray'].is_initialized())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=240)
    assert proc.stdout.startswith("refused: --workers 1000 with Ray on this machine (--address local): it has "), proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("| ray started: False") and not list(tmp_path.iterdir())
