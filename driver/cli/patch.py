"""`driver patch`: activation patching from a patch file, with its tables, heatmaps and summary."""

from __future__ import annotations

import os

import click

from driver.checks import settings
from driver.checks.cluster import check_address, check_workers
from driver.checks.files import check_cache, writable_folder
from driver.checks.errors import one_line
from driver.cli.errors import resumable, usage_errors
from driver.cli.run import GROUP_HELP, SPLIT_HELP, WORKERS_HELP
from driver.lm.evaluation import on_workers
from driver.lm.quiet import phase, say


@click.command("patch")
@click.argument("patch_file", type=click.Path(dir_okay=False))
@click.option("--workers", default="all", show_default=True, help=WORKERS_HELP)
@click.option("--address", default=None, help="Ray cluster: auto, HOST:PORT, or local. Default: $RAY_ADDRESS, else local.")
@click.option("--output", "--output-path", "--output_path", "output", default=None,
              help="Output folder. Default: orchard-out/<patch file name>.")  # fmt: skip
@click.option("--cache", default=None, help="Result cache folder. Default: OUTPUT/cache.")
@click.option("--threads", type=settings.WHOLE, default=None, help="BLAS/OpenMP threads per worker (several workers on one machine).")
@click.option("--group-size", "--group_size", "group_size", default=None, help=f"{GROUP_HELP} Default: the file's model.group_size, else 1.")
@click.option("--split", default=None, help=f"{SPLIT_HELP} Default: the file's model.split, else auto.")
def patch_command(
    patch_file: str, workers: str, address: str | None, output: str | None, cache: str | None, threads: int | None,
    group_size: str | None, split: str | None,
) -> None:  # fmt: skip
    """Activation patching: which layer, position and head carry a behaviour, over PATCH_FILE's prompt pairs.

    Every cell (site x layer x position, or head at attn_head, x method) runs on every pair, spread over the
    workers. Writes results.csv, pairs.jsonl, summary.md, run.json and heatmaps under OUTPUT. The file, its
    model and its pairs are checked before any worker starts; every finished cell is cached under OUTPUT/cache:
    rerun an interrupted or grown run and only what is missing runs. docs/patching.md defines the numbers.
    """
    from driver.patch import PatchError, default_output, load_patch, run, write_outputs  # heavy: at the call
    from driver.patch.groups import resolve

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with usage_errors():
        flags = (None if group_size is None else settings.group_size(group_size), None if split is None else settings.split(split))
    check_workers(workers)
    folder = writable_folder(output if output else default_output(patch_file), "--output")
    try:
        with phase(f"checking {patch_file} against its model and pairs", after=1.0, transient=True):
            plan = load_patch(patch_file)
    except PatchError as e:
        raise click.ClickException(str(e)) from None
    check_cache(cache or folder / "cache", "--cache" if cache else "the result cache")
    check_address(address)
    grouping, notes = resolve(plan, flags, workers, address)
    try:
        with resumable(cache or folder / "cache"):
            outcome = run(plan, workers=workers, address=address, output=folder, cache=cache, threads=threads,
                          grouping=grouping, notes=notes, echo=say)  # fmt: skip
    except ValueError as e:  # PatchError: equal logit differences (known after the first pass); a worker's refusal
        raise click.ClickException(one_line(str(e))) from None
    except RuntimeError as e:  # cluster.ClusterError: every worker lost (finished cells stay in the cache)
        raise click.ClickException(one_line(str(e))) from None
    with phase(f"writing results.csv, summary.md and plots under {folder}"):
        written = write_outputs(outcome, folder)
    _report(outcome, folder, written)


def _report(outcome, folder, written: dict) -> None:
    from driver.patch.report import facts

    run = facts(outcome)
    click.echo(f"{len(outcome.patch.cells)} cells x {len(outcome.patch.pairs)} pairs {on_workers(run)} in {run['wall_s']:.1f} s "
               f"({run['cells_computed']} computed at {run['cells_per_s']:.1f} cells/s, {run['cells_cached']} from cache)")  # fmt: skip
    click.echo(f"results: {folder} (summary.md, results.csv, pairs.jsonl, {len(written['plots'])} plots)")
