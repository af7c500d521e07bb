"""Worker groups as the user names them (`--group-size K|auto`, `--split auto|pipeline|tensor`): resolved on the
head to a `worker.spec.Grouping` and checked before Ray starts or any model loads. A group is K `mlx` nodes
holding one copy of the model split across them; `--workers N` asks for N groups (N*K nodes)."""

from __future__ import annotations

from pathlib import Path

from worker.spec import Grouping
from worker.split import smallest_size

from driver.checks.errors import BadUsage, Refused

AUTO_SPLIT = "pipeline"  # one transfer per stage per forward: fine over Ethernet; tensor wants Thunderbolt/RDMA


def split_line() -> str:
    return (f"--split auto: {AUTO_SPLIT} (contiguous layers per node, one transfer per stage per forward; "
            "--split tensor suits Thunderbolt/RDMA links)")  # fmt: skip


def size_line(size: int) -> str:
    return f"--group-size auto: {size} (the fewest nodes whose memory for models holds the model's weights)"


def chosen_lines(size: int | str, split: str, found: Grouping) -> list[str]:
    """What auto chose, one line each (a command says them once its workers start: a refusal stays one line)."""
    return [size_line(found.size)] * (size == "auto") + [split_line()] * (split == "auto" and found.size > 1)


def tell_chosen(size: int | str, split: str, found: Grouping) -> None:
    tell(chosen_lines(size, split, found))


def tell(lines: list[str]) -> None:
    """What auto chose, on stderr as phase lines (`driver: ...`), unless --quiet."""
    from driver.lm.quiet import say

    for line in lines:
        say(line)


def share_fits(need_gb: float, size: int, have_gb: float) -> bool:
    """Whether one rank's share of `need_gb` of weights (split `size` ways) fits in `have_gb` for models."""
    return need_gb / size <= have_gb


def too_large(need_gb: float, have_gb: float, size: int, where: str) -> str:
    """One line: the weights' share does not fit a node; names the group size that would."""
    fit = smallest_size(need_gb, have_gb)
    now = f"a share of 1/{size} ({need_gb / size:.1f} GB)" if size > 1 else "them whole"
    return (f"the model's weights ({need_gb:.1f} GB) do not fit in the {have_gb:.1f} GB {where} has for "
            f"models, holding {now}: pass --group-size {fit} (or auto) to split it across {fit} nodes, or use a smaller "
            "or quantized model")  # fmt: skip


def check_split(config: dict, size: int, split: str) -> None:
    """worker.split.check's line (heads not divisible, more ranks than layers, a family without shard)."""
    from worker.split import check

    problem = check(config, size, split) or (split == "pipeline" and _blocks_problem(config))
    if problem:
        raise BadUsage(problem)


def _blocks_problem(config: dict) -> str | None:
    """Why a pipeline cannot cut this model's decoder blocks, asked of its weightless skeleton; None if it can, or
    if the skeleton cannot be built here (each rank then checks as it loads)."""
    try:
        from worker.hooks.skeleton import skeleton
        from worker.split.pipeline import unsplittable

        model = skeleton(config)
    except Exception:  # noqa: BLE001 - no MLX here, or a family mlx-lm cannot build from its config alone
        return None
    if unsplittable(model) is None:
        return None
    return f"a pipeline split cannot find the list of decoder blocks of mlx-lm's {config.get('model_type', 'model')} model: use --group-size 1"


def nodes_memory(address: str | None) -> tuple[list[float], str]:
    """(GB each `mlx` node has for models, what the nodes are): this machine for the embedded Ray (its
    processes share it); a cluster's nodes asked through Ray, no model loaded."""
    from cluster.connect import LOCAL, source_of
    from cluster.facts import mlx_device

    if source_of(address)[0] == LOCAL:
        return [mlx_device()["model_memory_gb"]], "this machine"
    from cluster import ClusterError, connect, node_facts

    try:
        connection = connect(address)
    except ClusterError as e:
        raise Refused(str(e)) from None
    try:
        return [f["model_memory_gb"] for f in node_facts()], "the cluster's smallest node"
    finally:
        connection.close()


def resolve_size(size: int | str, folder: Path, address: str | None) -> int:
    """A group size, auto resolved (the fewest nodes whose memory for models holds the weights); a share too
    large for a node refused in one line naming the size that would fit."""
    from cluster.connect import LOCAL, source_of
    from worker.load import weights_bytes

    if size != "auto" and source_of(address)[0] != LOCAL:
        return int(size)  # a cluster's nodes are asked only for auto: each rank checks its own share as it loads
    need = weights_bytes(folder) / 2**30
    memories, where = nodes_memory(address)
    have = min(memories) if memories else 0.0
    if size == "auto":
        size = smallest_size(need, have) or 1
    if not share_fits(need, int(size), have):
        raise Refused(too_large(need, have, int(size), where))
    return int(size)


def grouping(size: int | str, split: str, *, config: dict, folder: Path, address: str | None) -> Grouping:
    """The Grouping a run uses: auto resolved, the split checked against the model's shape, the share against
    the nodes' memory. Nothing loads; Ray is joined only for --group-size auto on a cluster (its nodes' memory)."""
    k = resolve_size(size, folder, address)
    chosen = AUTO_SPLIT if split == "auto" else split
    if k > 1:
        check_split(config, k, chosen)
    return Grouping(size=k, split=chosen)


def for_command(size: int | str, split: str, workers: str, *, model: str, folder: Path, address: str | None) -> Grouping:
    """`grouping` for a command's flags, after the model folder and the address are checked; an auto size
    checked again against this machine's room for N groups (driver.checks.cluster). Says nothing: the command
    says `chosen_lines` once its workers start."""
    from driver.checks.cluster import check_workers
    from driver.checks.model import model_config

    found = grouping(size, split, config=model_config(folder), folder=folder, address=address)
    if size == "auto" and found.size > 1:
        check_workers(workers, address, model, found.size)
    return found
