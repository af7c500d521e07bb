"""`driver nodes`: one line per Ray node (host, chip, memory, MLX, versions), checked for `mlx` units and versions."""

from __future__ import annotations

import click

from driver.checks.cluster import check_address


@click.command()
@click.option("--address", default=None, help="Ray cluster: auto, HOST:PORT, or local. Default: $RAY_ADDRESS, else local.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object ({address, nodes, warnings}) instead of lines.")
def nodes(address: str | None, as_json: bool) -> None:
    """One line per node: id, host, OS/arch, chip, memory, MLX device and the memory it recommends for models,
    BLAS, versions, `mlx` units, alive. Exit 1 when no node offers `mlx` or the `mlx` nodes' versions differ."""
    import json

    from cluster import ClusterError, connect, node_facts
    from cluster.facts import mismatch, node_line, node_rows, slow_blas

    check_address(address)  # syntax (exit 2), reachable, token authentication: no Ray yet
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
    if as_json:
        warnings = [w for w in (warning, differ) if w]
        click.echo(json.dumps({"address": connection.address, "nodes": rows, "warnings": warnings}, indent=1))
    else:
        for row in rows:
            click.echo(node_line(row))
    if warning:
        click.echo(warning, err=True)
    if differ:  # `driver run` refuses such a cluster: say so now, in one line, with the fix
        raise click.ClickException(differ)
