"""Worker failures in one line: which worker, on which node, what happened (killed for memory, died, could not
load its model) and the fix. Ray's own messages run to dozens of lines; these read its actor table instead.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

_OOM_NODE = re.compile(r"Memory on the node \(IP: ([^,]+), ID: ([0-9a-f]+)\) was ([\d.]+\s*\w+) used / ([\d.]+\s*\w+) limit")
_EXIT_DETAIL = re.compile(r"Worker exit detail: (.*?)(?:\. |$)")
MEMORY_FIX = (
    "use a smaller or quantized model, free memory on that node, or give its Ray a higher RAY_memory_usage_threshold"
)


def _nodes() -> dict[str, dict]:
    import ray

    try:
        return {n["NodeID"]: n for n in ray.nodes()}
    except Exception:
        return {}


def node_label(node_id: str | None, ip: str | None = None) -> str:
    """'vm (10.0.0.2, node 1a2b3c4d)': host name, address and id prefix (several nodes may share a host)."""
    node = _nodes().get(node_id or "", {})
    host = node.get("NodeManagerHostname")
    ip = node.get("NodeManagerAddress") or ip
    parts = [p for p in (ip, f"node {node_id[:8]}" if node_id else None) if p]
    return f"{host or 'node'} ({', '.join(parts)})" if parts else (host or "an unknown node")


def _actor_record(actor_id: str | None) -> dict:
    import ray

    if not actor_id:
        return {}
    try:
        return ray._private.state.actors(actor_id=actor_id) or {}
    except Exception:
        return {}


def _actor_id(actor: Any) -> str | None:
    try:
        return actor._actor_id.hex()
    except AttributeError:
        return None


def _death(record: dict) -> tuple[str, str | None]:
    """(what happened, the OOM message if Ray killed it for memory) from an actor table record."""
    cause = record.get("DeathCause")
    if cause is None:
        return "died", None
    try:
        if cause.HasField("oom_context"):
            return "was killed by Ray for running out of memory", cause.oom_context.error_message
        message = cause.actor_died_error_context.error_message if cause.HasField("actor_died_error_context") else str(cause)
    except (AttributeError, ValueError):
        message = str(cause)
    detail = _EXIT_DETAIL.search(message)
    return f"died ({detail.group(1).strip() if detail else message.strip().splitlines()[0][:160]})", None


def _memory(oom: str | None) -> tuple[str | None, str]:
    """(node id, 'node memory A used of B') parsed from Ray's OOM report."""
    m = _OOM_NODE.search(oom or "")
    if not m:
        return None, ""
    return m.group(2), f"node memory {m.group(3)} used of {m.group(4)}"


def weights_gb(path: str | None) -> str:
    """'W GB of weights' for a local model folder, else ''."""
    from pathlib import Path

    from worker.load import weights_bytes

    folder = Path(path).expanduser() if path else None
    if folder is None or not folder.is_dir():
        return ""
    try:
        total = weights_bytes(folder)
    except OSError:
        return ""
    if not total:
        return ""
    return f"{total / 2**30:.1f} GB of weights" if total >= 2**30 else f"{total / 2**20:.1f} MB of weights"


def describe(error: BaseException, actors: Sequence[Any], rank: int, *, doing: str, model: str | None = None) -> str:
    """One line for worker `rank` that died while `doing` ("loading M"): where, what happened, the fix."""
    from ray.exceptions import OutOfMemoryError

    record = _actor_record(_actor_id(actors[rank]))
    address = record.get("Address") or {}
    if isinstance(error, OutOfMemoryError):
        what, oom = "was killed by Ray for running out of memory", str(error)
    else:
        what, oom = _death(record)
    oom_node, memory = _memory(oom)
    node_id = address.get("NodeID") or oom_node
    where = node_label(node_id, address.get("IPAddress"))
    if oom is not None:
        details = ", ".join(x for x in (memory, weights_gb(model)) if x)
        return f"worker w{rank} on {where} {what} while {doing}{f' ({details})' if details else ''}: {MEMORY_FIX}"
    return f"worker w{rank} on {where} {what} while {doing}: see that node's Ray logs (`ray logs raylet.out --node-id {node_id or '<id>'}`)"


def load_failure(actors: Sequence[Any], rank: int, message: str, model: str) -> str:
    """Worker `rank`'s ModelLoadError (raised inside it), with its node and, for a model missing there, the fix."""
    address = _actor_record(_actor_id(actors[rank])).get("Address") or {}
    where = node_label(address.get("NodeID"), address.get("IPAddress"))
    fix = ""
    if "Hugging Face" in message or "does not exist" in message:
        fix = (f": the model must be on every node: `driver stage --model {model}` (or `driver run --stage`) copies it "
               f"to each, or download it there (`hf download {model}`) or copy it to the same path")
    return f"worker w{rank} on {where} cannot load the model: {message}{fix}"


def lost_workers(actors: Sequence[Any]) -> str:
    """'w0 on vm (...) was killed by Ray for running out of memory; w1 ... died (...)' for the dead ones."""
    lines = []
    for i, a in enumerate(actors):
        record = _actor_record(_actor_id(a))
        if record.get("State") not in ("DEAD", "RESTARTING"):
            continue
        what, oom = _death(record)
        address = record.get("Address") or {}
        oom_node, memory = _memory(oom)
        lines.append(f"w{i} on {node_label(address.get('NodeID') or oom_node, address.get('IPAddress'))} {what}{f' ({memory})' if memory else ''}")
    if not lines:
        return ""
    memory = any("out of memory" in line for line in lines)
    return "; ".join(lines) + (f" ({MEMORY_FIX})" if memory else "")


def start_problem(error: Exception) -> str:
    """Why the embedded Ray did not start (Ray's own words), in one line with the fix for the case."""
    import tempfile
    from os import environ

    said = " ".join((str(error).strip().splitlines() or [type(error).__name__])[0].split())
    folder = environ.get("RAY_TMPDIR") or tempfile.gettempdir()  # where Ray keeps its sessions, as Ray picks it
    if "AF_UNIX path length" in said:
        fix = f"set RAY_TMPDIR to a short folder such as /tmp (Ray's socket paths under {folder} pass 107 bytes)"
    elif "timed out during startup" in said:
        fix = ("this machine was too busy for Ray's raylet to start within Ray's 30 s: rerun when it is quieter, or "
               "start Ray once (`driver cluster up`) and pass its --address")  # fmt: skip
    else:
        fix = f"Ray's own logs are in {folder}/ray/session_latest/logs"
    return f"Ray could not start on this machine ({said}): {fix}"


_FORWARDING = {"on": True}


def stdout_for_results() -> None:
    """Ray prints what reaches the driver from the cluster (the raylet's "A worker died or was killed ..." and any
    worker output) on stdout when it is not an error stream: send all of it to stderr, so that stdout holds the
    results only (`driver run ... > table.md` stays clean). Ray looks the printer up by name at each print."""
    from ray._private import worker as ray_worker

    _FORWARDING["on"] = True  # each command forwards again until it says its Error line
    for owner, name in ((ray_worker, "print_to_stdstream"), (ray_worker.global_worker_stdstream_dispatcher, "emit")):
        original = getattr(owner, name, None)  # the raylet's lines / the worker log lines Ray forwards
        if original is not None and not getattr(original, "orchard_stderr", False):
            setattr(owner, name, _on_stderr(original))



def stop_forwarding() -> None:
    """Drop what Ray forwards from now on: the driver's `Error:` line is the last one the user reads (the raylet's
    notices of the workers it saw die otherwise arrive after it, from Ray's own thread, or from the lines it held
    back as repeats, which it prints when it disconnects)."""
    _FORWARDING["on"] = False
    logging = sys.modules.get("ray._private.ray_logging")
    for held in (getattr(logging, "stdout_deduplicator", None), getattr(logging, "stderr_deduplicator", None)):
        if held is not None:
            held.flush()  # what it returns is dropped


def _on_stderr(printer: Callable) -> Callable:
    def on_stderr(data: dict, *args: Any, **kwargs: Any) -> None:
        if _FORWARDING["on"]:
            printer({**data, "is_err": True}, *args, **kwargs)

    on_stderr.orchard_stderr = True  # type: ignore[attr-defined]
    return on_stderr
