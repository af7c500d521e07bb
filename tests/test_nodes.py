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
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
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


def test_nodes_without_the_token_or_with_a_wrong_one_is_one_line(up: Up):
    proc = driver("nodes", "--address", up.address, env=_env(up.home))
    line = one_line_error(proc, f"the Ray cluster at {up.address} requires token authentication")
    assert "RAY_AUTH_MODE=token" in line and "ray get-auth-token" in line
    wrong = up.home / "wrong"
    wrong.write_text("0" * 64)
    proc = driver("nodes", "--address", up.address, env=_env(up.home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(wrong)))
    one_line_error(proc, f"rejects the token from RAY_AUTH_TOKEN_PATH={wrong}")


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
    assert proc.returncode == 0 and proc.stdout.startswith("export RAY_AUTH_MODE=token ")
    proc = driver("cluster", "up", "--nodes", "2", env=_env(up.home))
    one_line_error(proc, f"a local cluster is already running at {up.address} ({NODES} nodes)")


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


def test_down_stops_every_process_of_the_cluster(up: Up):
    from cluster import local

    procs = local.processes(up.state)
    assert len(procs) >= NODES
    proc = driver("cluster", "down", env=_env(up.home))
    assert proc.returncode == 0 and f"stopped the local cluster at {up.address}" in proc.stdout, proc.stderr
    time.sleep(0.5)
    left = [p for p in procs if _running(p)]
    assert not left and not local.processes(up.state), left
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
