"""Which Ray a command uses, as the README says: `eval "$(driver cluster status --env)"` exports the address too,
and `driver nodes` says which Ray it asks (the embedded one lists this machine only)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import ray
from click.testing import CliRunner

from driver.cli import main


@pytest.fixture
def recorded(ray_cluster, tmp_path, monkeypatch):
    """A `driver cluster up` record (state.json) pointing at the session's cluster, whose GCS port answers."""
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path))
    host, port = ray_cluster.address.rsplit(":", 1)
    token = tmp_path / "local-cluster" / "auth_token"
    token.parent.mkdir(parents=True)
    token.write_text("0" * 64)
    state = {"address": ray_cluster.address, "port": int(port), "token_file": str(token), "nodes": 4}
    (token.parent / "state.json").write_text(json.dumps(state))
    from cluster.connect import read_state

    assert read_state() == state, "the record sits where `driver cluster up` writes it"
    return state


def test_status_env_exports_the_address_and_the_token(recorded):
    result = CliRunner().invoke(main, ["cluster", "status", "--env"])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("\n") == 1 and result.stdout.startswith("export ")
    exported = dict(word.split("=", 1) for word in shlex.split(result.stdout.removeprefix("export ")))
    assert exported["RAY_ADDRESS"] == recorded["address"]
    assert exported["RAY_AUTH_TOKEN_PATH"] == recorded["token_file"] and exported["RAY_AUTH_MODE"] == "token"


def test_nodes_says_which_ray_it_asks(ray_cluster):
    result = CliRunner().invoke(main, ["nodes"])  # this process is joined to the session's cluster
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == f"driver: using the Ray cluster this process is connected to, at {ray_cluster.address}, to list its nodes"
    # one line a node on stdout; earlier tests may have added and removed nodes of the session cluster (shown DEAD)
    alive = [line for line in result.stdout.splitlines() if not line.endswith("DEAD")]
    assert len(alive) == sum(node["Alive"] for node in ray.nodes())


def test_the_embedded_ray_is_named_with_the_local_cluster_it_does_not_use(recorded):
    """What `driver nodes` (or run) without an address says when a `driver cluster up` cluster answers: that it
    starts an embedded Ray, not that cluster, and how to use it (asked in a process that has no Ray yet)."""
    code = "from cluster.connect import describe; import sys; print(describe(None)); print(describe(sys.argv[1]))"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", code, recorded["address"]], capture_output=True, text=True, env=env, check=True)
    alone, named = proc.stdout.splitlines()
    assert alone.startswith("starting Ray on this machine (embedded; not the local cluster at " + recorded["address"])
    assert "eval \"$(driver cluster status --env)\"" in alone
    assert named == f"joining the Ray cluster at {recorded['address']} (the local cluster `driver cluster up` started)"
