"""`driver stage`: put a model on every `mlx` node before a run (cluster.stage), one line per node."""

from __future__ import annotations

import click

from driver.checks.cluster import check_address, check_address_syntax
from driver.lm.quiet import phase, say


@click.command()
@click.option("--model", "model", required=True, help="Local model folder or Hugging Face repo id (mlx-lm format).")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) for a repo id.")
@click.option("--address", default=None, help="Ray cluster: auto, HOST:PORT, or local. Default: $RAY_ADDRESS, else local.")
def stage(model: str, revision: str | None, address: str | None) -> None:
    """Copy MODEL into a verified cache folder on every `mlx` node ($ORCHARD_HOME/models there).

    Each node downloads a Hub repo itself when it can; anything still missing streams from this machine in
    pieces of at most 64 MiB, each checked by sha256. A rerun moves only what is missing or damaged.
    """
    from cluster import ClusterError, connect
    from cluster.stage import source_folder, stage as run_stage
    from worker.load import ModelLoadError
    from worker.staged import StageError

    check_address_syntax(address)  # exit 2
    try:
        source_folder(model, revision)  # a bad path or an unreachable repo fails before Ray starts
    except ModelLoadError as e:
        raise click.ClickException(str(e)) from None
    check_address(address)  # syntax (exit 2), reachable, token authentication
    from cluster.connect import describe

    say(f"{describe(address)}, to stage {model}")
    try:
        connection = connect(address)
    except ClusterError as e:
        raise click.ClickException(str(e)) from None
    try:
        with phase(f"staging {model} on every `mlx` node (pieces of at most 64 MiB, each checked by sha256)"):
            report = run_stage(model, revision=revision)
    except (StageError, ClusterError, ModelLoadError) as e:
        raise click.ClickException(str(e)) from None
    finally:
        connection.close()
    for n in report.nodes:
        hub = f"  hub: {n.hub}" if n.hub else ""
        click.echo(
            f"{n.host:<20} {n.node_id[:12]}  sent {n.files_sent} files ({n.bytes_sent / 1e6:.1f} MB, "
            f"{n.rate:.1f} MB/s), kept {n.files_kept}{hub}"
        )
    click.echo(
        f"staged {report.name} ({report.files} files, {report.bytes / 1e6:.1f} MB) on {len(report.nodes)} node{'s' * (len(report.nodes) != 1)} "
        f"in {report.seconds:.1f} s as {report.staged_model}"
    )
