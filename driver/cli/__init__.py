"""`driver`: the command group, its one-line errors, and its commands (one module each; heavy imports inside them)."""

from __future__ import annotations

from functools import partial

import click

from driver.cli import cluster, demo, nodes, patch, run, stage, steer, sweep, vectors
from driver.cli.errors import OneLineErrors
from driver.cli.options import hide_aliases
from driver.lm.quiet import quiet_option


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="orchard", prog_name="driver", message="%(prog)s (Orchard) %(version)s")
@partial(quiet_option, top=True)
def main() -> None:
    """Orchard: lm-eval benchmarks across a Ray cluster of Apple-silicon Macs, one MLX model per Mac.

    Each Mac joins the cluster with `ray start --address HEAD:6379 --resources='{"mlx": 1}'`; `driver run`
    places one worker per such node. With no --address (and no RAY_ADDRESS) Ray runs on this machine only.

    Every command says on stderr what it is doing (lines starting `driver:`); stdout holds only its results.
    """


main.add_command(run.run)
main.add_command(demo.demo)
main.add_command(vectors.vectors)
main.add_command(sweep.sweep_command)
main.add_command(nodes.nodes)
main.add_command(stage.stage)
main.add_command(cluster.cluster)
main.add_command(steer.steer)
main.add_command(patch.patch_command)

for command in main.commands.values():  # every command takes --quiet too (`driver run --quiet ...`)
    for sub in getattr(command, "commands", {}).values():
        quiet_option(sub)
    quiet_option(command)
    hide_aliases(command)  # --help shows one name per option: `--output`, not also `--output-path, --output_path`
