"""`driver nodes`: one line per Ray node (host, chip, memory, MLX, versions), checked for `mlx` units and versions."""

from __future__ import annotations

import click

from driver.checks import settings
from driver.checks.cluster import check_address, check_workers
from driver.cli.errors import usage_errors
from driver.lm.quiet import say


@click.command()
@click.option("--address", default=None, help="Ray cluster: auto, HOST:PORT, or local. Default: $RAY_ADDRESS, else local.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object ({address, nodes, warnings}) instead of lines.")
@click.option("--workers", default=None, help="With --group-size: the groups a run with --workers N would form (default all).")
@click.option("--group-size", "--group_size", "group_size", default=None, help="Show the worker groups of K nodes a run would form.")
def nodes(address: str | None, as_json: bool, workers: str | None, group_size: str | None) -> None:
    """One line per node: id, host, OS/arch, chip, memory, MLX device and the memory it recommends for models,
    BLAS, versions, `mlx` units, alive. Exit 1 when no node offers `mlx` or the `mlx` nodes' versions differ.
    With --workers/--group-size, then the groups a run would form (which nodes in which group), or one line
    saying why they do not fit."""
    import json

    with usage_errors():
        size = None if workers is None and group_size is None else settings.whole("--group-size", group_size or 1, 1, "nodes per group")
    if workers is not None:
        check_workers(workers)

    from cluster import ClusterError, connect, node_facts
    from cluster.facts import mismatch, node_line, node_rows, slow_blas

    check_address(address)  # syntax (exit 2), reachable, token authentication: no Ray yet
    from cluster.connect import describe

    say(f"{describe(address)}, to list its nodes")  # an embedded Ray lists this machine only: say so
    try:
        connection = connect(address)  # imports Ray (in the mode the address needs)
    except ClusterError as e:
        raise click.ClickException(str(e)) from None
    import ray

    try:
        facts, table = node_facts(), ray.nodes()
    finally:
        connection.close()
    if not facts:
        raise click.ClickException(
            f"no alive node offers the `mlx` resource ({len(table)} node{'s' * (len(table) != 1)} without it): "
            "start each Mac with ray start --resources='{\"mlx\": 1}' (deploy/ray-mac.sh does)"
        )
    rows, warning, differ = node_rows(table, facts), slow_blas(facts), mismatch(facts, who="nodes")
    groups = None if size is None else run_groups(rows, workers or "all", size, connection.embedded)
    if as_json:
        warnings = [w for w in (warning, differ) if w]
        shown = {} if groups is None else {"groups": [[r["node_id"] for r in g] for g in groups]}
        click.echo(json.dumps({"address": connection.address, "nodes": rows, "warnings": warnings, **shown}, indent=1))
    else:
        for row in rows:
            click.echo(node_line(row))
        for line in group_lines(groups or [], connection.embedded):
            click.echo(line)
    if warning:
        click.echo(warning, err=True)
    if differ:  # `driver run` refuses such a cluster: say so now, in one line, with the fix
        raise click.ClickException(differ)


def run_groups(rows: list[dict], workers: str, size: int, embedded: bool) -> list[list[dict]]:
    """The groups `driver run --workers W --group-size K` forms on these nodes (each `mlx` node in one group, in
    this order); on the embedded Ray every rank is a process of this machine (its default: one group)."""
    from cluster import ClusterError
    from cluster.groups import group_count

    usable = [r for r in rows if r.get("alive") and r.get("mlx_units", 0) >= 1]
    if embedded:
        n = 1 if workers == "all" else int(workers)
        return [usable[:1] * size for _ in range(n)]
    try:
        n = group_count(workers, size)  # as the run counts them: one line when they do not fit
    except ClusterError as e:
        raise click.ClickException(str(e)) from None
    return [usable[g * size:(g + 1) * size] for g in range(n)]


def group_lines(groups: list[list[dict]], embedded: bool) -> list[str]:
    """One line per group: its ranks' nodes (rank 0 first)."""
    where = " (processes of this machine, a ring over 127.0.0.1)" if embedded else " (one node per rank; Ray picks which)"
    head = [f"{len(groups)} group{'s' * (len(groups) != 1)} of {len(groups[0])}{where}:"] if groups else []
    return head + [f"  group {g}: " + ", ".join(f"rank {r} {n.get('hostname')} ({n['node_id'][:12]})" for r, n in enumerate(group))
                   for g, group in enumerate(groups)]  # fmt: skip
