"""`driver`: the command group, its one-line errors, and its commands (one module each; heavy imports inside them)."""

from __future__ import annotations

import click

from driver.cli import cluster, demo, nodes, run, stage, steer, sweep, vectors
from driver.cli.errors import OneLineErrors


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """Orchard: lm-eval benchmarks across a Ray cluster of Apple-silicon Macs, one MLX model per Mac.

    Each Mac joins the cluster with `ray start --address HEAD:6379 --resources='{"mlx": 1}'`; `driver run`
    places one worker per such node. With no --address (and no RAY_ADDRESS) Ray runs on this machine only.
    """


main.add_command(run.run)
main.add_command(demo.demo)
main.add_command(vectors.vectors)
main.add_command(sweep.sweep_command)
main.add_command(nodes.nodes)
main.add_command(stage.stage)
main.add_command(cluster.cluster)
main.add_command(steer.steer)
