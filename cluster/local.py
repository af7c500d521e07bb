"""A multi-node Ray cluster on this machine, for trying Orchard without Macs: N `ray start` processes on loopback.

Every node binds 127.0.0.1 only and offers one `mlx` unit, like N Macs, and the cluster runs with token
authentication (`RAY_AUTH_MODE=token`), like the deploy path. The token is generated once, kept with 0600 permissions
in `$ORCHARD_HOME/local-cluster/auth_token` (default `~/.cache/orchard/...`), outside any repository, and never
printed: drivers read it from the file (`RAY_AUTH_TOKEN_PATH`). `state.json` next to it records the address and the
cluster's private Ray temp folder, which is how `down` finds the cluster's processes (their command lines name that
folder), so `down` never touches another Ray on this machine, as `ray stop` would.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .connect import HOST, ClusterError, home, read_state

STOP_HINT = "stop it with `driver cluster down`"
# `ray start` for a second node: Ray only joins a cluster with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 on macOS, and with
# it Ray rewrites 127.0.0.1 (the head's and this node's) into this machine's network address, where a loopback head
# does not listen. Ray's own `ray start`, keeping 127.0.0.1 as given.
JOIN_LOOPBACK = (
    "import sys, ray._private.services as s; s.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"
)
RAY_CLI = "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"


def token_file() -> Path:
    """The cluster's token: created once (as Ray's `get-auth-token --generate` does: 32 random bytes, hex), 0600."""
    path = home() / "auth_token"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)  # whatever a user did to it, only its owner reads it
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def driver_env(state: dict) -> dict[str, str]:
    """What a driver on this machine sets to use the cluster: its token, and Ray dialing 127.0.0.1 as is."""
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": state["token_file"],
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }


def answers(state: dict) -> bool:
    """Whether the head's GCS port still accepts connections."""
    try:
        socket.create_connection((HOST, state["port"]), timeout=2).close()
        return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _node_env(state: dict, join: bool, extra: dict | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(
        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=state["token_file"], RAY_TMPDIR=state["temp_dir"],
        RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1" if join else "0",
    )  # fmt: skip
    return {**env, **(extra or {})}


def _start_command(state: dict, join: bool) -> list[str]:
    node = [
        "--node-ip-address", HOST, "--resources", json.dumps({"mlx": state.get("mlx", 1)}), "--num-cpus", str(state["cpus"]),
        "--temp-dir", state["temp_dir"], "--disable-usage-stats", "--dashboard-agent-listen-port", str(_free_port()),
    ]  # fmt: skip
    if join:
        return [sys.executable, "-c", JOIN_LOOPBACK, "start", "--address", state["address"], *node]
    head = ["--head", "--port", str(state["port"]), "--include-dashboard", "false", "--ray-client-server-port", str(_free_port())]
    return [sys.executable, "-c", RAY_CLI, "start", *head, *node]


def _launch(state: dict, join: bool, extra: dict | None = None) -> subprocess.Popen:
    command = _start_command(state, join)
    return subprocess.Popen(command, env=_node_env(state, join, extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen], timeout: float = 180) -> None:
    """Wait for `ray start` processes; the first failure becomes one line (Ray's last line of output)."""
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise ClusterError(f"`ray start` did not finish within {timeout:.0f} s: check `ray` runs in this environment") from None
        if proc.returncode != 0:
            lines = [line.strip() for line in out.splitlines() if line.strip()]
            last = next((line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1] if lines else "")
            raise ClusterError(f"`ray start` failed ({last[:300]}): see the logs under the cluster's temp folder")


def _write_state(state: dict) -> None:
    path = home() / "state.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def alive_nodes(state: dict) -> list:
    """The GCS's alive nodes (GcsNodeInfo), asked with the token: what `ray.nodes()` shows, without joining Ray."""
    import grpc
    from ray.core.generated import gcs_pb2, gcs_service_pb2, gcs_service_pb2_grpc

    token = Path(state["token_file"]).read_text().strip()
    with grpc.insecure_channel(state["address"]) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            reply = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=5, metadata=(("authorization", f"Bearer {token}"),))
        except grpc.RpcError as e:
            raise ClusterError(f"the local cluster at {state['address']} does not answer ({e.code().name}): {STOP_HINT}, then start it again") from None
    return [n for n in reply.node_info_list if n.state == gcs_pb2.GcsNodeInfo.ALIVE]


def _wait_for(state: dict, count: int, timeout: float = 60) -> None:
    """Until `count` nodes are alive in the GCS (a busy GCS may not answer at first)."""
    deadline, seen = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        try:
            seen = len(alive_nodes(state))
        except ClusterError:
            seen = 0
        if seen >= count:
            return
        time.sleep(0.3)
    raise ClusterError(f"only {seen} of {count} Ray nodes registered within {timeout:.0f} s: {STOP_HINT} and retry")


def up(nodes: int, cpus: int = 1, mlx: int = 1) -> dict:
    """Start a head and `nodes - 1` more nodes on 127.0.0.1, each with `mlx` units (one, like a Mac); returns the
    state."""
    if nodes < 1:
        raise ClusterError(f"--nodes {nodes}: a cluster needs at least 1 node")
    old = read_state()
    if old and answers(old):
        raise ClusterError(f"a local cluster is already running at {old['address']} ({old['nodes']} nodes): use it, or {STOP_HINT} first")
    if old:
        down()  # a stale record (its head is gone): clear what is left of it
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="orchard-rc-", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    state = {"address": f"{HOST}:{port}", "port": port, "nodes": nodes, "cpus": cpus, "mlx": mlx, "temp_dir": temp,
             "token_file": str(token_file()), "started": time.time()}  # fmt: skip
    _write_state(state)  # first, so `down` finds a half-started cluster too
    try:
        _finish([_launch(state, join=False)])
        for _ in range(nodes - 1):  # one at a time: Ray gives a node 30 s to register, too short for several at once on a busy machine
            _finish([_launch(state, join=True)])
        _wait_for(state, nodes)
    except BaseException:
        down()
        raise
    return state


def join(state: dict, env: dict | None = None) -> None:
    """One more node in the running local cluster (`env`: extra variables for its processes)."""
    count = len(alive_nodes(state)) + 1
    _finish([_launch(state, join=True, extra=env)])
    _wait_for(state, count)
    state["nodes"] = count
    _write_state(state)


def _of_cluster(p, temp_dir: str) -> bool:
    """Whether a process belongs to the cluster: its command line names the cluster's temp folder, or it runs with
    that folder as RAY_TMPDIR (set for every `ray start` of `up`, so inherited by all Ray starts: Ray's client
    server, `ray.util.client.server --address=...`, names neither folder nor node in its command line)."""
    import psutil

    if temp_dir in " ".join(p.info["cmdline"] or []):
        return True
    try:
        return p.environ().get("RAY_TMPDIR") == temp_dir
    except psutil.Error:
        return False


def processes(state: dict) -> list:
    """The cluster's processes (`_of_cluster`) and their children (Ray's workers rename themselves `ray::...`)."""
    import psutil

    found: set = set()
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and _of_cluster(p, state["temp_dir"]):
                found.add(p)
                found.update(p.children(recursive=True))
        except psutil.Error:
            pass
    return [p for p in found if p.pid != os.getpid()]


def _terminate(procs: list, timeout: float = 5) -> None:
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=timeout)


def down() -> dict | None:
    """Stop the local cluster (only its processes) and forget it; the token stays for the next `up`. None if there
    was none."""
    state = read_state()
    if state is None:
        return None
    _terminate(processes(state))
    if Path(state["temp_dir"]).name.startswith("orchard-rc-"):  # never remove a folder this module did not make
        shutil.rmtree(state["temp_dir"], ignore_errors=True)
    (home() / "state.json").unlink(missing_ok=True)
    return state
