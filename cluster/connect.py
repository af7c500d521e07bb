"""Connect to Ray: a running cluster of Macs (`auto`, `HOST:PORT`), or an embedded Ray on this machine (`local`).

Everything that can be wrong with an address is found before `ray.init` (which otherwise retries for ~20 s and
prints a warning a second): its syntax (named as `--address` or `RAY_ADDRESS`, wherever it came from), whether
anything listens there, and whether the cluster takes this driver's token. `auto` means the cluster `ray start`
started on this machine (the one `ray status` shows), never another process's embedded session.

Token authentication (Ray >= 2.5x turns it on by default): a cluster started with `RAY_AUTH_MODE=token`, or by
`ray start` while a token exists (`~/.ray/auth_token`, which every embedded `ray.init` creates), refuses a driver
that does not send its token. A driver sends one only with `RAY_AUTH_MODE=token`, taken from `RAY_AUTH_TOKEN`,
else the file `RAY_AUTH_TOKEN_PATH`, else `~/.ray/auth_token` (`ray get-auth-token` on the head prints it). For an
explicit address Ray never enables that by itself (a token is not sent to whatever address is typed); for `auto`
(a cluster on this machine) it does when a token exists, and so does Orchard."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import failures
from .embedded import session

LOCAL = "local"
START_HINT = "start one with `ray start --head --resources='{\"mlx\": 1}'`, or pass --address local"
PROBE_TIMEOUT = 3.0
HOST = "127.0.0.1"  # where the local cluster (cluster.local) binds
FOLDER = "local-cluster"


class ClusterError(RuntimeError):
    """A cluster problem stated in one line, naming the fix."""


class AddressError(ClusterError):
    """An address that is not one (a usage error when it came from the command line)."""


@dataclass
class Connection:
    address: str  # "local" for the embedded Ray, else the cluster's GCS address
    embedded: bool  # started here: close() stops it

    def close(self) -> None:
        import ray

        if self.embedded and ray.is_initialized() and not session.ending():  # after the CLI's Ctrl-C: killed at exit
            folder = session.folder()
            with signals_held():
                ray.shutdown()
            session.remove_session(folder)  # one left per run otherwise


@contextlib.contextmanager
def signals_held():
    """Ctrl-C or SIGTERM waits until the block ends, then acts as it would have (a Ray shutdown cut halfway leaves
    its C++ core to exit the process with status 1, not the command's 130, and its processes behind)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []  # a second Ctrl-C: stop now, Ray's processes killed (cluster.embedded.session)
    held = {s: signal.signal(s, lambda signum, frame: session.end_now() if caught else caught.append(signum))
            for s in (signal.SIGINT, signal.SIGTERM)}  # fmt: skip
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


def source_of(address: str | None) -> tuple[str, str]:
    """(address, where it came from: "--address", "RAY_ADDRESS" or "default")."""
    if address:
        return address, "--address"
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env:
        return env, "RAY_ADDRESS"
    return LOCAL, "default"


def _split(address: str) -> tuple[str, int] | None:
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    digits = port.isascii() and port.isdigit()  # int() reads '٦٣٧٩' as 6379; str.isdigit() passes '²'
    if not sep or not host or not digits or not 0 < int(port) < 65536 or any(c in host for c in "/ @?#"):
        return None
    return host, int(port)


def check_syntax(address: str, source: str = "--address") -> None:
    """auto, local, ray://..., or HOST:PORT; else an AddressError naming the flag or variable it came from."""
    if address in (LOCAL, "auto") or address.startswith("ray://"):
        return
    if _split(address) is None:
        shown = f"RAY_ADDRESS={address!r}" if source == "RAY_ADDRESS" else f"--address {address!r}"
        fix = ", or unset RAY_ADDRESS" if source == "RAY_ADDRESS" else ""
        raise AddressError(f"{shown} is not a Ray address: use auto, local or HOST:PORT (e.g. 10.0.0.2:6379){fix}")


def _reachable(address: str, source: str = "--address", timeout: float = PROBE_TIMEOUT) -> None:
    check_syntax(address, source)
    host, port = _split(address)  # type: ignore[misc]
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        origin = " (from RAY_ADDRESS)" if source == "RAY_ADDRESS" else ""
        raise ClusterError(f"cannot reach a Ray cluster at {address}{origin} ({reason}): {START_HINT}") from None


def started_cluster() -> str:
    """The address `ray start --head` recorded on this machine (RAY_TMPDIR honoured), checked to be alive."""
    from ray._common.utils import get_ray_address_file
    from ray._private.utils import read_ray_address

    path = get_ray_address_file(None)
    address = read_ray_address()
    if not address:
        raise ClusterError(f"--address auto: no Ray cluster was started with `ray start` on this machine (no {path}): {START_HINT}")
    try:
        _reachable(address)
    except ClusterError:
        raise ClusterError(
            f"--address auto: {path} names {address}, but no Ray cluster answers there (stopped?): {START_HINT}"
        ) from None
    return address


# --- token authentication ----------------------------------------------------------------------------------------


def token_source() -> tuple[str | None, str | None]:
    """(where Ray would take this driver's token from, in its own order, or None; what is wrong with it, or None)."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return "RAY_AUTH_TOKEN", None
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        p = Path(path).expanduser()
        try:
            ok = p.is_file() and bool(p.read_text(errors="replace").strip())
        except OSError:
            ok = False
        if not ok:
            return None, f"RAY_AUTH_TOKEN_PATH={path}: the file does not exist or is empty: point it at the cluster's token"
        return f"RAY_AUTH_TOKEN_PATH={path}", None
    default = Path.home() / ".ray" / "auth_token"
    found = default.is_file() and default.stat().st_size > 0
    return (str(default).replace(str(Path.home()), "~", 1) if found else None), None


def _token_metadata() -> tuple:
    from ray._raylet import AuthenticationTokenLoader

    return tuple(AuthenticationTokenLoader.instance().get_token_for_http_header(ignore_auth_mode=True).items())


def _enable_token_auth() -> None:
    """What `ray.init(address="auto")` does when a token exists and RAY_AUTH_MODE is unset (this process and its
    children send the token)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    from ray._raylet import Config

    Config.initialize("")


def _ask(address: str, metadata: tuple):
    """The GCS's answer to GetClusterId (the first call `ray.init` makes): None if fine, else the gRPC error."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=PROBE_TIMEOUT, metadata=metadata)
        except grpc.RpcError as e:
            return e
    return None


def home() -> Path:
    """Where the local cluster (cluster.local) keeps its token and state: $ORCHARD_HOME/local-cluster, else
    ~/.cache/orchard/local-cluster ($XDG_CACHE_HOME honoured)."""
    from worker.identity import memo_path

    return memo_path().parent / FOLDER


def read_state() -> dict | None:
    """The local cluster's state.json (its address, port and token file), None without one."""
    try:
        return json.loads((home() / "state.json").read_text())
    except (OSError, ValueError):
        return None


def _local_token(address: str) -> str | None:
    """The token file of the local cluster (`driver cluster up`, cluster.local) when `address` is its address."""
    state, target = read_state(), _split(address)
    if not state or target is None:
        return None
    host, port = target
    return state["token_file"] if port == state.get("port") and host in (HOST, "localhost") else None


def probe(address: str, source: str = "--address", *, auto: bool = False) -> None:
    """Reachable, a Ray GCS, and it takes this driver's credentials; else one line saying what to set."""
    import grpc

    _reachable(address, source)
    mode, (token, problem) = os.environ.get("RAY_AUTH_MODE"), token_source()
    if problem and mode == "token":
        raise ClusterError(problem)
    if auto and mode is None and token is not None:
        mode = "token"  # as ray.init(address="auto") does for a cluster on this machine
        _enable_token_auth()
    error = _ask(address, _token_metadata() if mode == "token" and token else ())
    if error is None:
        return
    code = error.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        needs = f"the Ray cluster at {address} requires token authentication"
        ours = _local_token(address)
        if ours and os.environ.get("RAY_AUTH_TOKEN_PATH") != ours:
            said = f"the Ray cluster at {address} rejects the token from {token}" if mode == "token" and token else needs
            raise ClusterError(
                f"{said}: it is the local cluster `driver cluster up` started, whose token is {ours}: set RAY_AUTH_MODE=token "
                f"RAY_AUTH_TOKEN_PATH={ours}{' and unset RAY_AUTH_TOKEN' if os.environ.get('RAY_AUTH_TOKEN') else ''} "
                f"(`eval \"$(driver cluster status --env)\"` sets them)"
            )
        fix = "RAY_AUTH_TOKEN=<the cluster's token> (`ray get-auth-token` on the head node prints it; or RAY_AUTH_TOKEN_PATH=<file>)"
        if problem:
            raise ClusterError(f"{needs}: set RAY_AUTH_MODE=token; and {problem}")
        if mode not in (None, "token", "disabled"):
            raise ClusterError(f"RAY_AUTH_MODE={mode!r} is not a mode Ray knows (it reads it as disabled) and {needs}: set RAY_AUTH_MODE=token")
        if mode != "token" and token:
            raise ClusterError(f"{needs}: set RAY_AUTH_MODE=token to send the token in {token} (or also set {fix})")
        if mode != "token":
            raise ClusterError(f"{needs}: set RAY_AUTH_MODE=token and {fix}")
        if token is None:
            raise ClusterError(f"RAY_AUTH_MODE=token but this driver has no token for the Ray cluster at {address}: set {fix}")
        raise ClusterError(f"the Ray cluster at {address} rejects the token from {token}: set {fix}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        raise ClusterError(f"no answer from a Ray cluster at {address} within {PROBE_TIMEOUT:.0f} s: is it the head's GCS port (default 6379)?")
    detail = (error.details() or code.name).strip().splitlines()[0]
    raise ClusterError(f"{address} does not answer as a Ray cluster ({detail}): pass the head's GCS address, HOST:6379 by default")


def _loopback_rewrite(address: str) -> None:
    """Ray dials a loopback address as this machine's network address (unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0);
    a head started with --node-ip-address 127.0.0.1 listens on loopback only, so say so instead of retrying."""
    host, port = _split(address)  # type: ignore[misc]
    try:
        from ray._private.services import resolve_ip_for_localhost

        dialed = resolve_ip_for_localhost(host)
    except Exception:
        return
    if dialed == host:
        return
    try:
        socket.create_connection((dialed, port), timeout=PROBE_TIMEOUT).close()
    except OSError:
        raise ClusterError(
            f"Ray would dial {address} as {dialed}:{port} (this machine's address), where the cluster does not listen "
            "(started with --node-ip-address 127.0.0.1?): set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 for a one-machine "
            "cluster, or start the head with this machine's address"
        ) from None


def ray_mode(address: str) -> None:
    """Before Ray is imported (it reads this once): the embedded session stays on loopback (on Linux Ray would
    otherwise advertise this machine's network address); joining a cluster needs multi-node mode (off by default
    on macOS). A value the user set wins."""
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0" if address == LOCAL else "1")


def resolve(address: str | None) -> tuple[str, str]:
    """(target, source) for a cluster address, all checks done but `ray.init`: target is LOCAL, a ray:// URL,
    or a GCS address that answered and accepts this driver."""
    address, source = source_of(address)
    ray_mode(address)
    check_syntax(address, source)
    if address == LOCAL or address.startswith("ray://"):
        return address, source
    if address == "auto":
        target = started_cluster()
        probe(target, source, auto=True)
    else:
        target = address
        probe(target, source)
    _loopback_rewrite(target)
    return target, source


def _local_cluster() -> str | None:
    """The address of the cluster `driver cluster up` started (cluster.local), when it answers."""
    state = read_state()
    if not state or "port" not in state:
        return None
    try:
        socket.create_connection((HOST, state["port"]), timeout=0.5).close()
    except OSError:
        return None
    return state.get("address") or f"{HOST}:{state['port']}"


def describe(address: str | None) -> str:
    """What `connect(address)` will do, in words for a phase line: start an embedded Ray or join which cluster
    (and, with no address given, the `driver cluster up` cluster it does not use)."""
    ray = sys.modules.get("ray")
    current = ray.get_runtime_context().gcs_address if ray is not None and ray.is_initialized() else None
    if current and address in (None, "auto", current):  # connect() reuses it
        return f"using the Ray cluster this process is connected to, at {current}"
    target, source = source_of(address)
    ours = _local_cluster()
    if target == LOCAL:
        if source != "default" or not ours:
            return "starting Ray on this machine (embedded" + (", no --address or RAY_ADDRESS)" if source == "default" else ")")
        return (f"starting Ray on this machine (embedded; not the local cluster at {ours}: pass --address {ours} "
                f"or eval \"$(driver cluster status --env)\" to use it)")  # fmt: skip
    origin = " (from RAY_ADDRESS)" if source == "RAY_ADDRESS" else ""
    if target == "auto":
        return f"joining the Ray cluster `ray start` started on this machine{origin}"
    mine = " (the local cluster `driver cluster up` started)" if ours and _split(ours) == _split(target) else ""
    return f"joining the Ray cluster at {target}{origin}{mine}"


def _init(ray, **kwargs) -> None:
    """ray.init, ended at once by Ctrl-C or SIGTERM in the CLI (cluster.embedded.session), its own error leaving
    nothing of this Ray. The process's own SIGTERM handler (driver: Ctrl-C's) stays."""
    import ray._private.utils as ray_utils

    if not callable(signal.getsignal(signal.SIGTERM)) or threading.current_thread() is not threading.main_thread():
        return ray.init(**kwargs)
    own, ray_utils.set_sigterm_handler = ray_utils.set_sigterm_handler, lambda _: None
    try:
        with session.cut_at_once():
            ray.init(**kwargs)
    except BaseException:  # ray.init's own error: nothing of this Ray stays
        Connection(LOCAL, embedded=True).close()  # (joined to a cluster: only this process's connection ends)
        raise
    finally:
        ray_utils.set_sigterm_handler = own


def connect(address: str | None = None, *, local_workers: int = 1, dashboard: bool = False) -> Connection:
    """Join the cluster at `address` (None: $RAY_ADDRESS, else embedded), or reuse this process's Ray connection.

    The embedded Ray binds 127.0.0.1 and offers `local_workers` units of the `mlx` resource, so N workers run on
    this machine exactly as they would on N Macs.
    """
    ray_mode(source_of(address)[0])
    # The executor gets every result it uses and says a failure in one line; the refs it drops on purpose (a lost
    # group's other ranks, failing on the broken ring) would otherwise be printed by Ray at garbage collection as
    # "Unhandled error" tracebacks ("[ring] connection to a peer was lost"). Read by Ray at print time.
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    import ray

    failures.stdout_for_results()

    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if address not in (None, "auto", current):  # one process holds one Ray connection
            if address != LOCAL and not address.startswith("ray://"):
                _reachable(address)
            raise ClusterError(f"this process is already connected to Ray at {current}: it cannot also join {address}")
        return Connection(current, embedded=False)
    target, source = resolve(address)
    # Workers' own output stays in their Ray logs: the driver reports their failures itself, in one line.
    quiet = {"logging_level": logging.WARNING, "log_to_driver": False}
    if target == LOCAL:
        # Ray's note that it turned token auth on for the embedded session (loopback only) is not news here.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        try:
            with session.token_told():
                _init(ray, address="local", _node_ip_address="127.0.0.1", include_dashboard=dashboard,
                      resources={"mlx": local_workers}, **quiet)  # fmt: skip
        except Exception as e:  # Ray's own start failed (not Ctrl-C): a raylet that never registered, a long socket path
            raise ClusterError(failures.start_problem(e)) from None
        return Connection(LOCAL, embedded=True)
    from ray.exceptions import RayError

    try:
        _init(ray, address=target, **quiet)
    except (ConnectionError, RuntimeError, ValueError, RayError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        origin = " (from RAY_ADDRESS)" if source == "RAY_ADDRESS" else ""
        raise ClusterError(f"cannot connect to Ray at {target}{origin}: {first}") from None
    return Connection(target, embedded=False)
