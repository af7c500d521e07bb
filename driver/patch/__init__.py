"""Activation patching (`driver patch FILE.yaml`, issue 37): which layer, position and head carry a behaviour,
over many prompt pairs, as a distributed, cached sweep of cells. From Python:

    from driver.patch import patch
    outcome = patch("study.yaml", workers=2, output="orchard-out/study")  # checks, runs, writes the outputs

or step by step: `load_patch(FILE)` (every check, no worker), `run(plan, output=...)` (or `run_on(executor,
plan)`), `write_outputs(outcome, folder)`. docs/patching.md defines the numbers."""

from __future__ import annotations

import os
from pathlib import Path

from driver.patch.groups import resolve
from driver.patch.plan import Patch, load_patch
from driver.patch.report import write_outputs
from driver.patch.running import Outcome, run, run_on
from driver.patch.schema import PatchError, PatchFile

__all__ = ["PatchError", "PatchFile", "Patch", "Outcome", "load_patch", "run", "run_on", "write_outputs", "patch", "default_output"]


def default_output(file: str | os.PathLike) -> Path:
    """orchard-out/<the file's name without its suffix>."""
    return Path("orchard-out") / Path(file).stem


def patch(file: str | os.PathLike, *, workers: str | int = "all", address: str | None = None, output: str | os.PathLike | None = None,
          **options) -> Outcome:  # fmt: skip
    """`driver patch FILE` from Python: check, run on `workers` (groups per the file's model section), write the
    outputs into `output` (default orchard-out/<file name>); `options`: run's (cache, threads, stage, echo)."""
    folder = Path(output) if output is not None else default_output(file)
    plan = load_patch(file)
    grouping, notes = resolve(plan, workers=str(workers), address=address)
    outcome = run(plan, workers=str(workers), address=address, output=folder, grouping=grouping, notes=notes, **options)
    write_outputs(outcome, folder)
    return outcome
