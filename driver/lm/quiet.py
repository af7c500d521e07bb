"""Silence, at their source, the library messages a user of `driver` cannot act on (and SIGTERM is Ctrl-C).

Each filter drops only the named messages; every other warning still shows. `install()` runs before
transformers, lm-eval or Ray are imported (the CLI's entry point)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading

# logger name -> message fragments to drop, and why the user cannot act on them
_DROPPED = {
    # Orchard never runs PyTorch models: transformers serves only the tokenizer.
    "transformers": ("PyTorch was not found",),
    # lm-eval applies the metric's standard aggregation; the task's author, not its user, could write it down.
    "lm_eval.api.task": ("is defined, but aggregation is not", "is defined, but higher_is_better is not"),
}


class _Drop(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # the command's Ctrl-C path: finished work kept, Ray shut down, one line


def install() -> None:
    for name, fragments in _DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):  # once per process
            logger.addFilter(_Drop(fragments))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def git_commit_hash() -> str | None:
    """lm-eval's get_git_commit_hash without git's `fatal: not a git repository` on stderr outside a repository."""
    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)  # noqa: S607
        return out.stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        from lm_eval.loggers.utils import get_commit_from_path

        return get_commit_from_path(os.getcwd())


def quiet_lm_eval() -> None:
    """Call after importing lm_eval: its evaluator records the git hash of the working folder, if any."""
    import lm_eval.evaluator

    lm_eval.evaluator.get_git_commit_hash = git_commit_hash
