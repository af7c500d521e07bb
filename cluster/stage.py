"""Put a model on every `mlx` node before a run (`driver stage`), so workers load a local, verified copy.

The head builds the model's manifest (worker.staged: every identity file with its size and sha256, from
worker.identity's memo) and places one small `StageNode` actor on each alive `mlx` node (pinned there with
NodeAffinitySchedulingStrategy(soft=False), no CPU or `mlx` unit held, so it runs beside a busy worker). Each
says which pieces it lacks (a second run: none, so nothing moves) and whether the pieces still to come fit on
its disk. For a Hub repo id a node that lacks anything first downloads the repo itself and adopts the files
whose sha256 matches the head's; whatever is still missing is streamed from the head.

Streaming: the head reads each missing piece (at most `PIECE` = 64 MiB: one Ray object each, as macOS caps
the object store at 2 GiB) once, `ray.put`s it once and sends that one object to every node that lacks it;
at most `PIECES_IN_FLIGHT` pieces are out at a time, whatever the number of nodes, so the head's object
store holds at most 2 x 64 MiB of staging data. A node checks each piece's sha256 before writing it; a
damaged piece is read and sent again. A lost node or a Ctrl-C leaves every written piece journaled:
rerunning resumes from there.

`stage(model)` returns a StageReport; a worker then loads `report.staged_model` (`staged:<content id>`,
resolved on the node by worker.staged.resolve).
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from worker import staged
from worker.spec import ModelSpec
from worker.staged import PIECE, StageError

from .connect import ClusterError
from .place import MLX_HINT, RESOURCE, mlx_nodes

PIECES_IN_FLIGHT = 2  # pieces out at once (each to every node lacking it): bounds the object store's load
RETRIES = 3  # a piece that arrives damaged is read and sent again this many times


class StageNode:
    """The node's side of staging, one actor per `mlx` node; thin over worker.staged (tests subclass it)."""

    def __init__(self, name: str, cid: str, entries: list[dict], piece_size: int = PIECE):
        self.name, self.cid, self.piece_size = name, cid, piece_size
        self.entries = {e["path"]: e for e in entries}
        self.folder = staged.folder_for(name, cid)

    def where(self) -> dict:
        import ray

        return {"host": staged.host(), "node_id": ray.get_runtime_context().get_node_id(), "folder": str(self.folder)}

    def free_bytes(self) -> int:
        return staged.free_bytes(self.folder)

    def needs(self) -> dict[str, list[int]]:
        """Pieces lacking per file; refuses in one line when they would not fit on this node's disk."""
        entries = list(self.entries.values())
        missing = staged.needs(self.folder, entries, self.cid, self.piece_size)
        staged.check_space(self.folder, staged.bytes_needed(entries, missing, self.piece_size), self.free_bytes(), self.name)
        return missing

    def from_hub(self, repo: str, revision: str | None) -> str:
        """Download the repo on this node (its own Hub access, mlx-lm's file patterns) and adopt every file whose
        sha256 is the manifest's; a note in one line either way (offline is not an error: the head streams)."""
        try:
            from mlx_lm.utils import _download

            snapshot = Path(_download(repo, revision=revision))
        except Exception as e:  # offline, no such repo, gated...
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return f"no Hub download on {staged.host()} ({first[:160]})"
        adopted = staged.adopt(self.folder, list(self.entries.values()), snapshot)
        return f"{adopted} files from the Hub"

    def write(self, rel: str, index: int, data: Any, digest: str) -> bool:
        return staged.write_piece(self.folder, self.entries[rel], index, data, digest, self.piece_size)

    def finish(self) -> str:
        staged.finish(self.folder, self.cid)
        return str(self.folder)


@dataclass
class NodeReport:
    host: str
    node_id: str
    folder: str
    files_sent: int = 0  # files that needed at least one piece from the head
    files_kept: int = 0  # files already in place and verified
    pieces_sent: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0  # from the first piece out to this node's last piece written
    hub: str = ""  # the node's own Hub download, for a repo id: what it gave
    missing: dict[str, set[int]] = field(default_factory=dict, repr=False)

    @property
    def rate(self) -> float:
        """MB/s moved to this node (0 when nothing moved)."""
        return self.bytes_sent / 1e6 / self.seconds if self.seconds > 0 else 0.0


@dataclass
class StageReport:
    model: str
    name: str
    content_id: str
    files: int
    bytes: int
    nodes: list[NodeReport]
    seconds: float

    @property
    def staged_model(self) -> str:
        """The model string a worker loads: `ModelSpec(model=report.staged_model)`."""
        return staged.PREFIX + self.content_id


def source_folder(model: str, revision: str | None = None) -> tuple[Path, str]:
    """(the head's local copy, a folder name for it): a checked local folder, or the Hub snapshot the head gets
    (from its cache when offline); ModelLoadError in one line otherwise."""
    from worker.load import is_local, resolve

    path = resolve(model, revision)
    return path, (path.name if is_local(model) else model.replace("/", "--"))


def _get(node: NodeReport, ref: Any, name: str) -> Any:
    """ray.get, with a node's failure said in one line."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return ray.get(ref)
    except RayTaskError as e:
        if isinstance(e.cause, StageError):
            raise StageError(" ".join(str(e.cause).split())) from None
        if isinstance(e.cause, OSError):  # the node's disk: full, read-only, permissions
            raise StageError(f"{node.host} ({node.node_id[:12]}): {' '.join(str(e.cause).split())}") from None
        raise
    except RayActorError as e:
        raise StageError(
            f"node {node.host} ({node.node_id[:12]}) was lost while staging {name} after {node.pieces_sent} pieces "
            f"({_reason(e)}): rerun `driver stage` to resume where it stopped"
        ) from None


def _get_all(pairs: list[tuple[NodeReport, Any]], name: str) -> list:
    """Every node's answer, in order; a failure is raised once all are in (Ray prints a traceback for a failed
    answer nobody read)."""
    results, first = [], None
    for node, ref in pairs:
        try:
            results.append(_get(node, ref, name))
        except Exception as e:
            first = first or e
            results.append(None)
    if first is not None:
        raise first
    return results


def _drain(refs: list) -> None:
    """Read answers that a failure left unread, ignoring theirs (they are not news after the first)."""
    import ray

    for ref in refs:
        try:
            ray.get(ref, timeout=30)
        except Exception:
            pass


def _reason(error: Exception) -> str:
    """The last `SomeError: ...` line of a Ray actor failure (e.g. the node lacks Orchard), else a plain word."""
    found = [line.strip() for line in str(error).splitlines() if re.match(r"\s*\w+(Error|Exception): ", line)]
    return found[-1][:200] if found else "its staging process exited"


def _read_piece(path: Path, index: int, size: int, piece_size: int) -> tuple[np.ndarray, str]:
    import hashlib

    length = min(piece_size, size - index * piece_size)
    buf = np.empty(length, dtype=np.uint8)  # sent as a numpy array: the node reads it from its object store, no copy
    with open(path, "rb") as f:
        f.seek(index * piece_size)
        got = f.readinto(memoryview(buf))
    if got != length:
        raise StageError(f"{path} changed on the head while staging (shorter than its manifest says): run `driver stage` again")
    return buf, hashlib.sha256(buf).hexdigest()


def _send(source: Path, entry: dict, index: int, piece_size: int, targets: list, actors: dict) -> dict:
    import ray

    data, digest = _read_piece(source / entry["path"], index, entry["size"], piece_size)
    ref = ray.put(data)
    writes = {id(n): (n, actors[n.node_id].write.remote(entry["path"], index, ref, digest)) for n in targets}
    return {"entry": entry, "index": index, "ref": ref, "digest": digest, "writes": writes, "len": len(data)}


def _settle(flight: dict, source: Path, piece_size: int, actors: dict, name: str, t0: float) -> None:
    """Wait for one piece on every node it went to; a damaged copy is read and sent again."""
    entry, index = flight["entry"], flight["index"]
    for node, ref in flight["writes"].values():
        for attempt in range(RETRIES + 1):
            if _get(node, ref, name):
                break
            if attempt == RETRIES:
                raise StageError(
                    f"piece {index} of {entry['path']} kept arriving damaged at {node.host} ({node.node_id[:12]}) "
                    f"after {RETRIES} resends: check that node's disk and network"
                )
            ref = _send(source, entry, index, piece_size, [node], actors)["writes"][id(node)][1]
        node.pieces_sent += 1
        node.bytes_sent += flight["len"]
        node.seconds = time.monotonic() - t0
    flight.clear()  # drops the piece's ref: its object can go


def stream(source: Path, entries: list[dict], nodes: list[NodeReport], actors: dict, piece_size: int, name: str) -> None:
    """Every missing piece, read and put once, to every node lacking it; at most PIECES_IN_FLIGHT out at once."""
    t0 = time.monotonic()
    inflight: collections.deque = collections.deque()
    try:
        for entry in entries:
            wanted = sorted(set().union(*(n.missing.get(entry["path"], set()) for n in nodes)))
            for index in wanted:
                targets = [n for n in nodes if index in n.missing.get(entry["path"], ())]
                inflight.append(_send(source, entry, index, piece_size, targets, actors))
                if len(inflight) >= PIECES_IN_FLIGHT:
                    _settle(inflight[0], source, piece_size, actors, name, t0)
                    inflight.popleft()
        while inflight:
            _settle(inflight[0], source, piece_size, actors, name, t0)
            inflight.popleft()
    except Exception:
        _drain([ref for flight in inflight for _, ref in flight.get("writes", {}).values()])
        raise


def _place(node_cls: type, nodes: list[dict], *args: Any) -> dict:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(node_cls)
    return {
        n["NodeID"]: remote.options(
            num_cpus=0, max_restarts=0, max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
        ).remote(*args)
        for n in nodes
    }  # fmt: skip


def _plan(model: str, revision: str | None, hub: bool, nodes: list[NodeReport], actors: dict, name: str) -> None:
    """Ask every node what it lacks; for a repo id, nodes lacking something try their own download first."""
    answers = _get_all([(n, actors[n.node_id].needs.remote()) for n in nodes], name)
    for n, missing in zip(nodes, answers):
        n.missing = {rel: set(idx) for rel, idx in missing.items()}
    if not hub:
        return
    lacking = [n for n in nodes if any(n.missing.values())]
    notes = _get_all([(n, actors[n.node_id].from_hub.remote(model, revision)) for n in lacking], name)
    for n, note in zip(lacking, notes):
        n.hub = note
    answers = _get_all([(n, actors[n.node_id].needs.remote()) for n in lacking], name)
    for n, missing in zip(lacking, answers):
        n.missing = {rel: set(idx) for rel, idx in missing.items()}


def stage(
    model: str, *, revision: str | None = None, piece_size: int = PIECE, node_cls: type = StageNode
) -> StageReport:
    """Make every alive `mlx` node of the connected cluster hold `model` (a local folder or a Hub repo id),
    verified file by file; returns what moved where. Errors (StageError, ClusterError, ModelLoadError) are one
    line. `piece_size` (at most PIECE) and `node_cls` are for tests."""
    import ray

    from worker.load import is_local

    if not 0 < piece_size <= PIECE:
        raise ValueError(f"piece_size must be within 1..{PIECE} bytes, not {piece_size}")
    t0 = time.monotonic()
    source, name = source_folder(model, revision)
    entries = staged.manifest(source)
    cid = staged.content_id(entries)
    alive = mlx_nodes()
    if not alive:
        raise ClusterError(f"the Ray cluster has no node with the `{RESOURCE}` resource to stage on: {MLX_HINT}")
    actors = _place(node_cls, alive, name, cid, entries, piece_size)
    try:
        places = _get_all([(NodeReport("?", node_id, ""), actor.where.remote()) for node_id, actor in actors.items()], name)
        nodes = [NodeReport(**where) for where in places]
        _plan(model, revision, not is_local(model), nodes, actors, name)
        for n in nodes:
            n.files_sent = sum(1 for idx in n.missing.values() if idx)
            n.files_kept = len(entries) - n.files_sent
        stream(source, entries, nodes, actors, piece_size, name)
        folders = _get_all([(n, actors[n.node_id].finish.remote()) for n in nodes], name)
        for n, folder in zip(nodes, folders):
            n.folder = folder
    finally:
        for actor in actors.values():
            ray.kill(actor, no_restart=True)
    total = sum(e["size"] for e in entries)
    return StageReport(model, name, cid, len(entries), total, nodes, time.monotonic() - t0)


def stage_model(spec: ModelSpec, tell: Callable[[str], None]) -> str:
    """Stage `spec`'s model on every `mlx` node; the model string the workers load; `tell`
    gets the line that says what moved. A staging failure is a ClusterError: one line, as every other cluster problem."""
    try:
        report = stage(spec.model, revision=spec.revision)
    except StageError as e:
        raise ClusterError(" ".join(str(e).split())) from None
    moved = sum(n.bytes_sent for n in report.nodes) / 1e6
    tell(f"staged {spec.model} on {len(report.nodes)} node{'s' * (len(report.nodes) != 1)} ({moved:.1f} MB moved)")
    return report.staged_model
