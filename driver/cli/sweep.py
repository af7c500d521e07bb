"""`driver sweep`: a steering sweep from a sweep file, with its tables, plots and summary."""

from __future__ import annotations

import os
from pathlib import Path

import click

from worker.spec import Grouping

from driver.checks import settings
from driver.checks.cluster import check_address, check_workers
from driver.checks.files import check_cache, writable_folder
from driver.checks.errors import BadUsage, Refused
from driver.checks.groups import chosen_lines, for_command
from driver.checks.model import check_heads_split
from driver.cli.errors import resumable, usage_errors
from driver.cli.run import GROUP_HELP, SPLIT_HELP, WORKERS_HELP, tell_cached
from driver.lm.evaluation import on_workers
from driver.lm.quiet import phase, say


@click.command("sweep")
@click.argument("sweep_file", type=click.Path(dir_okay=False))
@click.option("--workers", default="all", show_default=True, help=WORKERS_HELP)
@click.option("--address", default=None, help="Ray cluster: auto, HOST:PORT, or local. Default: $RAY_ADDRESS, else local.")
@click.option(
    "--output", "--output-path", "--output_path", "output", default=None,
    help="Output folder (as `driver run --output`). Default: orchard-out/<sweep file name>."
)
@click.option("--cache", default=None, help="Result cache folder. Default: OUTPUT/cache.")
@click.option("--threads", type=settings.WHOLE, default=None, help="BLAS/OpenMP threads per worker (several workers on one machine).")
@click.option("--stage", is_flag=True, help="Copy the model to every node first (driver stage); workers load that copy.")
@click.option("--group-size", "--group_size", "group_size", default=None, help=f"{GROUP_HELP} Default: the file's model.group_size, else 1.")
@click.option("--split", default=None, help=f"{SPLIT_HELP} Default: the file's model.split, else auto.")
def sweep_command(
    sweep_file: str, workers: str, address: str | None, output: str | None, cache: str | None, threads: int | None, stage: bool,
    group_size: str | None, split: str | None,
) -> None:  # fmt: skip
    """Run a steering sweep: every configuration of SWEEP_FILE's grid (layers × alphas × ...) on its tasks and
    prompt sets, the model loaded once per worker. Writes results.csv/.jsonl, generations.jsonl, summary.md,
    heatmaps and line plots, and lm-eval's JSON per configuration under OUTPUT.

    The whole file (model, vectors, layers, tasks, prompts) is checked before any worker starts. Every finished
    request is cached under OUTPUT/cache: rerun an interrupted or grown sweep and only what is missing runs.
    One sweep writes to OUTPUT at a time; a rerun replaces the outputs of the previous one (never the cache).
    """
    from driver.sweep import SweepError, load_sweep, outdir, report, run as run_sweep

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with usage_errors():
        flags = (None if group_size is None else settings.group_size(group_size), None if split is None else settings.split(split))
    check_workers(workers)
    folder = Path(output) if output else Path("orchard-out") / Path(sweep_file).stem
    writable_folder(folder, "--output")
    try:
        outdir.refuse_if_busy(folder)  # one writer per folder: a second sweep is refused before any work
        with phase(f"checking {sweep_file} against its model, vectors, tasks and prompts", after=1.0, transient=True):
            plan = load_sweep(sweep_file)  # seconds: mlx-lm's classes give the model's sites
    except (SweepError, outdir.FolderBusy) as e:
        raise click.ClickException(str(e)) from None
    check_cache(cache or folder / "cache", "--cache" if cache else "the result cache")
    check_address(address)
    grouping, notes = _grouping(plan, flags, workers, address, sweep_file)
    try:
        held = outdir.lock(folder)  # until this process exits
    except outdir.FolderBusy as e:
        raise click.ClickException(str(e)) from None
    try:
        with resumable(cache or folder / "cache"):
            outcome = run_sweep(
                plan, workers=workers, address=address, output=folder, cache=cache, threads=threads, stage=stage,
                grouping=grouping, notes=notes, echo=say,
            )
            with phase(f"writing the tables, summary.md and plots under {folder}"):
                written = report.write_outputs(outcome, folder)
    except ValueError as e:  # a request the model refuses (e.g. a prompt longer than the context window)
        raise click.ClickException(" ".join(str(e).split())) from None
    finally:
        outdir.unlock(held)
    facts = report.run_facts(outcome.info, outcome.seconds)
    click.echo(
        f"{len(plan.grid)} configuration{'s' * (len(plan.grid) != 1)} + baseline, {len(outcome.rows)} result rows {on_workers(facts)} in "
        f"{facts['wall_s']:.1f} s ({facts['requests_computed']} requests computed, {facts['requests_cached']} from cache)"
    )
    tell_cached(outcome.info, grouping, cache or folder / "cache")
    for line in report.problems(outcome.rows, written):
        click.echo(line, err=True)
    click.echo(f"results: {folder} (summary.md, results.csv, {2 * len(written['plots'])} plots)")


def _grouping(plan, flags: tuple, workers: str, address: str | None, sweep_file: str) -> tuple[Grouping, list[str]]:
    """The worker groups (a flag, else the sweep file's model.group_size / model.split), resolved and checked
    against the model and this machine before any worker starts (driver.checks.groups); what auto chose. A
    grouping the file alone asks for is refused as the file's other values are: naming it, exit 1."""
    from driver.lm.model_setup import tokenizer_folder

    model = plan.spec.model
    size, split = (flag if flag is not None else given for flag, given in zip(flags, (model.group_size, model.split)))
    pretrained = plan.model_args["pretrained"]
    folder = tokenizer_folder(pretrained, plan.model_args.get("revision"))
    try:
        found = for_command(size, split, workers, model=pretrained, folder=folder, address=address)
        check_heads_split(next((c.steering for c in plan.grid if c.head is not None), None), found)
    except BadUsage as e:
        if any(flag is not None for flag in flags):
            raise  # a flag's value: the command line (exit 2)
        said = e.format_message().replace("--split ", "split: ").replace("--group-size ", "group_size: ")  # the file's words
        raise Refused(f"{sweep_file}: model: {said} (group_size {size}, split {split})") from None
    if found.size > 1:
        check_workers(workers, address, pretrained, found.size)
    return found, chosen_lines(size, split, found)
