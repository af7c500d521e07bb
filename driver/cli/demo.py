"""`driver demo`: the shipped TinyStories-260K model on three story tasks, offline, on the embedded Ray."""

from __future__ import annotations

import os
from pathlib import Path

import click

from driver.checks import settings
from driver.checks.errors import BadUsage, Refused
from driver.checks.files import writable_folder
from driver.cli.errors import usage_errors
from driver.cli.run import GROUP_HELP, SPLIT_HELP, run


@click.command()
@click.option("--workers", default=4, show_default=True, type=settings.WHOLE, help="Workers on the embedded local Ray.")
@click.option(
    "--dir",
    "folder",
    default=None,
    help="Where the demo's tasks, results and cache go. Default: orchard-out/demo; with groups orchard-out/demo-groups-of-K "
         "(-tensor with --split tensor), so a grouped run computes instead of reading the plain run's cache.",
)
@click.option("--group-size", "--group_size", "group_size", default="1", show_default=True, help=GROUP_HELP)
@click.option("--split", default="auto", show_default=True, help=SPLIT_HELP)
@click.pass_context
def demo(ctx: click.Context, workers: int, folder: str | None, group_size: str, split: str) -> None:
    """Offline end-to-end run: the shipped TinyStories-260K model on three story tasks, WORKERS local workers.

    Writes the tasks (examples/tinystories: pick the coherent continuation, perplexity of short stories, finish
    a sentence) under DIR/tasks, runs `driver run` on the embedded Ray and shows a few of the model's
    continuations. Needs no network. `--workers 2 --group-size 2`: two groups, each holding the model split
    across two local processes (a ring over 127.0.0.1).
    """
    if workers < 1:
        raise BadUsage(f"--workers {workers}: at least 1 worker is needed")
    with usage_errors():  # before the demo writes its tasks
        size, split = settings.group_size(group_size), settings.split(split)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from driver.demo import MODEL, TASKS, write_story_tasks

    if not (MODEL / "config.json").is_file():
        raise Refused(f"the demo model is not at {MODEL}: run the demo from a clone of the project (pip install -e .)")
    root = Path(folder or default_folder(size, split))
    writable_folder(root, "--dir")
    tasks = write_story_tasks(root / "tasks")
    model = shown(MODEL)  # as a user would type it here: results under the folder `driver run` names the same
    done = ctx.invoke(
        run, model=model, tasks=",".join(TASKS), workers=str(workers), address="local", include_path=str(tasks),
        output_path=str(root / "out"), log_samples=True, batch_size="8", threads=1, steer=None, group_size=group_size,
        split=split,
    )  # fmt: skip
    click.echo("\nthe model's own words (tinystories_gen, greedy):")
    for sample in done.results["samples"]["tinystories_gen"][:3]:
        click.echo(f"  ...{sample['doc']['prompt'][-48:]} → {sample['resps'][0][0].strip()}")
    click.echo(f"\ntasks: {shown(tasks)} (try: driver run --model {model} --include-path {shown(tasks)} --tasks tinystories_mc)")


def default_folder(size: int | str, split: str) -> str:
    """The demo's folder for a grouping: the result cache does not depend on the grouping (the numbers do not), so
    a grouped demo in the plain demo's folder would be answered from its cache, on no group."""
    if size == 1:
        return "orchard-out/demo"
    return f"orchard-out/demo-groups-{'auto' if size == 'auto' else f'of-{size}'}{'-tensor' * (split == 'tensor')}"


def shown(path: Path) -> str:
    """A path as a user here would type it: relative when it lies below this folder, else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())
