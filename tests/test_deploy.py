"""deploy/: the `ray up` cluster YAML (Ray's own validation and Orchard's settings), `driver cluster check` on bad
YAMLs, and the shell scripts (bash -n, shellcheck, bootstrap-mac.sh's refusals). No Ray processes start here."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SCRIPTS = [DEPLOY / "bootstrap-mac.sh", DEPLOY / "ray-mac.sh"]


def _config() -> dict:
    return yaml.safe_load((DEPLOY / "cluster.yaml").read_text())


def _starts(config: dict) -> list[str]:
    return [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in config[key] if "ray start" in c]


def test_cluster_yaml_passes_rays_own_validation():
    """What `ray up` runs before it touches a machine (commands._bootstrap_config): prepare_config, then
    validate_config (Ray's JSON schema)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(_config())
    validate_config(prepared)
    node_type = prepared["available_node_types"]["local.cluster.node"]
    assert node_type["min_workers"] == node_type["max_workers"] == len(prepared["provider"]["worker_ips"])
    from driver.cli.cluster import check_config

    assert check_config(str(DEPLOY / "cluster.yaml")) is None


def test_cluster_yaml_has_what_macs_need():
    config = _config()
    assert config["provider"]["type"] == "local" and config["provider"]["head_ip"] and config["provider"]["worker_ips"]
    assert config["auth"]["ssh_user"] and config["auth"]["ssh_private_key"]
    starts = _starts(config)
    assert len(starts) == 2 and "--head" in starts[0] and "$RAY_HEAD_IP:6379" in starts[1]
    for command in starts:
        for needle in ("--resources='{\"mlx\": 1}'", "--node-ip-address=", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1",
                       "RAY_AUTH_MODE=token", "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor", "~/orchard/.venv/bin/ray"):  # fmt: skip
            assert needle in command, (needle, command)
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in starts[0]  # the head's autoscaler starts the workers
    # The token reaches every Mac through ray up's file_mounts, from the head's ~/.ray (outside this repository).
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    setup = " ; ".join(config["setup_commands"])
    assert "chmod 600 ~/.ray/auth_token" in setup and "ORCHARD_PYTHON=python3.11 bash deploy/bootstrap-mac.sh" in setup
    assert ".venv" in config["rsync_exclude"]  # each Mac builds its own venv


def test_ray_is_pinned_to_versions_with_token_auth():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "ray[default]>=2.52,<3" in deps


def _bad(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _edit(**changes) -> str:
    config = _config()
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = config
        for p in parents:
            node = node[p]
        if value is None:
            node.pop(last)
        else:
            node[last] = value
    return yaml.safe_dump(config)


BAD = {
    "syntax": ("cluster_name: orchard\nprovider: {type: local,\n", "line 3: not valid YAML"),
    "unknown key (Ray's schema)": (_edit(max_wrokers=2), "Additional properties are not allowed ('max_wrokers' was unexpected)"),
    "wrong type (Ray's schema)": (_edit(rsync_exclude="notalist"), "rsync_exclude: 'notalist' is not of type 'array'"),
    "no head_ip (Ray's local provider)": (_edit(provider__head_ip=None), "Please supply a `head_ip` and list of `worker_ips`"),
    "no mlx unit": (_edit(worker_start_ray_commands=["ray stop", "RAY_AUTH_MODE=token ray start --address=$RAY_HEAD_IP:6379"]),
                    "worker_start_ray_commands: `ray start` lacks --resources: add --resources='{\"mlx\": 1}'"),
    "no token mount": (_edit(file_mounts={"~/orchard": "."}), "file_mounts has no ~/.ray/auth_token"),
    "not the local provider": (_edit(provider={"type": "aws", "region": "us-west-2"}), "provider.type is 'aws'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_cluster_yaml_is_one_line_naming_the_fix(tmp_path: Path, case: str):
    from driver.cli.cluster import check_config

    text, expected = BAD[case]
    path = _bad(tmp_path, "cluster.yaml", text)
    line = check_config(path)
    assert line and line.startswith(path) and expected in line and "\n" not in line, line


def test_driver_cluster_check_is_one_line_and_exit_1(tmp_path: Path):
    from testbed.inproc import driver  # the real entry point, in this process

    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    path = _bad(tmp_path, "bad.yaml", BAD["no token mount"][0])
    proc = driver("cluster", "check", path, cwd=tmp_path, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"Error: {path}: file_mounts"), proc.stderr
    proc = driver("cluster", "check", DEPLOY / "cluster.yaml", cwd=tmp_path, env=env)
    assert proc.returncode == 0 and "valid for `ray up`" in proc.stdout, proc.stderr


# --- the shell scripts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse_and_are_shellcheck_clean(script: Path):
    assert os.access(script, os.X_OK), f"{script} is not executable"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; .ci/run installs it)")
    proc = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _shim(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _bootstrap(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(DEPLOY / "bootstrap-mac.sh"), *args], capture_output=True, text=True, env=env, timeout=60)


def test_bootstrap_refuses_what_is_not_an_apple_silicon_mac_in_one_line(tmp_path: Path):
    env = {**os.environ, "HOME": str(tmp_path)}
    if sys.platform != "darwin":
        proc = _bootstrap(env=env)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert "not macOS on Apple silicon (arm64)" in proc.stderr
    proc = _bootstrap("join", env=env)
    assert proc.returncode == 1 and "join needs the head's address" in proc.stderr
    proc = _bootstrap("frobnicate", env=env)
    assert proc.returncode == 1 and "use setup, head or join HEAD_IP" in proc.stderr


def test_bootstrap_checks_the_python_and_the_venv(tmp_path: Path):
    """On a stand-in `uname` that answers Darwin arm64: the Python checks, before anything is installed."""
    bin_ = tmp_path / "bin"
    _shim(bin_, "uname", 'case "$1" in -s) echo Darwin ;; -m) echo arm64 ;; esac')
    env = {**os.environ, "HOME": str(tmp_path), "PATH": f"{bin_}:{os.environ['PATH']}", "ORCHARD_VENV": str(tmp_path / "venv")}
    proc = _bootstrap(env={**env, "ORCHARD_PYTHON": "python3.0-absent"})
    assert proc.returncode == 1 and "python3.0-absent not found: install it" in proc.stderr, proc.stderr
    old = _shim(bin_, "oldpython", 'case "$2" in *print*) echo 3.9 ;; *) exit 1 ;; esac')
    proc = _bootstrap(env={**env, "ORCHARD_PYTHON": str(old)})
    assert proc.returncode == 1 and "is Python 3.9: Orchard needs 3.10 or newer" in proc.stderr, proc.stderr
    _shim(tmp_path / "venv" / "bin", "python", "echo 3.99")  # a venv made by another Python
    proc = _bootstrap(env={**env, "ORCHARD_PYTHON": sys.executable})
    assert proc.returncode == 1 and "has Python 3.99, not 3." in proc.stderr and "rm -rf" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1
