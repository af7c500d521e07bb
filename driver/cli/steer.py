"""`driver steer`: steering files from elsewhere, made into files Orchard reads (`convert`: lm-eval's .pt)."""

from __future__ import annotations

import click


@click.group()
def steer() -> None:
    """Steering files from other tools."""


@steer.command()
@click.argument("source", type=click.Path(dir_okay=False))
@click.option("--out", default=None, help="Folder for steer.yaml and vectors.safetensors (default: SOURCE without .pt).")
def convert(source: str, out: str | None) -> None:
    """Convert lm-eval's steered .pt SOURCE into steer.yaml + vectors.safetensors (for --steer).

    SOURCE is read with torch.load(weights_only=True): tensors and plain values only, no code runs. torch is
    needed for this command alone.
    """
    from pathlib import Path

    from driver.steering.convert import convert_pt
    from worker.spec import SteeringError

    folder = out or str(Path(source).with_suffix(""))
    try:
        spec, tensors = convert_pt(source, folder)
    except (SteeringError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {spec} and {tensors}: run with --steer {spec}")
