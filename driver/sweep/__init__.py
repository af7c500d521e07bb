"""Steering sweeps: a grid of steering configurations, each evaluated on lm-eval tasks and/or prompt sets."""

from driver.sweep.plan import Config, Prompt, Sweep, load_sweep
from driver.sweep.running import Outcome, run
from driver.sweep.schema import SweepError, SweepFile

__all__ = ["SweepError", "SweepFile", "Sweep", "Config", "Prompt", "Outcome", "load_sweep", "run"]
