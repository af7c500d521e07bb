"""What a user of `driver` sees on stderr: one line per phase of a command (`phase`, a spinner on a terminal while
it lasts; `--quiet` silences them and the progress bars), and, silenced at their source, the library messages a
user cannot act on (and SIGTERM is Ctrl-C).

Each filter drops only the named messages; every other warning still shows. `install()` runs before
transformers, lm-eval or Ray are imported (the CLI's entry point). stdout holds results only."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

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
    # datasets' "Generating test split: 12 examples" bars, one per split of every task: noise between the phases
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    # read when datasets is imported: an in-process caller has it already, or is importing it on another thread
    disable = getattr(sys.modules.get("datasets"), "disable_progress_bars", None)
    if disable is not None:
        disable()
    for name, fragments in _DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):  # once per process
            logger.addFilter(_Drop(fragments))
    _bars_in_place()
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
    """Call after importing lm_eval: its evaluator records the git hash of the working folder, if any; its
    tasks' context bars say whose contexts they count."""
    import lm_eval.evaluator

    lm_eval.evaluator.get_git_commit_hash = git_commit_hash
    _label_context_bars()


_BUILDING = threading.local()  # the task whose contexts lm-eval is building on this thread


def _label_context_bars() -> None:
    """lm-eval's Task.build_all_requests counts documents on a bar without a label: 'TASK contexts' instead."""
    import lm_eval.api.task as task

    if getattr(task, "_orchard_labelled", False):
        return
    build, bar = task.Task.build_all_requests, task.tqdm

    def build_all_requests(self, *args, **kwargs):
        _BUILDING.name = getattr(getattr(self, "config", None), "task", None)
        try:
            return build(self, *args, **kwargs)
        finally:
            _BUILDING.name = None

    def labelled(*args, **kwargs):
        name = getattr(_BUILDING, "name", None)
        return bar(*args, **({"desc": f"{name} contexts" if name else "contexts"} | kwargs))

    task.Task.build_all_requests, task.tqdm, task._orchard_labelled = build_all_requests, labelled, True


def _bars_in_place() -> None:
    """Off a terminal, every bar on line 0: tqdm gives a second bar open at once (the tokenizer's beside the
    workers') line 1, and writes cursor moves for it (a stray `ESC[A` in a log); on a terminal they are its layout."""
    if sys.stderr.isatty():
        return
    import tqdm.std

    if "_orchard_in_place" in tqdm.std.tqdm.__dict__:
        return
    init = tqdm.std.tqdm.__init__

    def in_place(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "position": kwargs.get("position") or 0})

    tqdm.std.tqdm.__init__, tqdm.std.tqdm._orchard_in_place = in_place, True


# --- phases ----------------------------------------------------------------------------------------------------------

PREFIX = "driver: "  # every phase line starts so: what the tool is doing, told apart from results and errors
SPIN = "|/-\\"


def quiet() -> bool:
    """`--quiet` (or ORCHARD_QUIET=1): no phase lines, no progress bars."""
    return os.environ.get("ORCHARD_QUIET", "") not in ("", "0")


_SET: dict[str, str | None] = {}  # what set_quiet changed: an in-process caller (tests) gets it back with off


def set_quiet(on: bool) -> None:
    """On: no phase lines, and no bar (lm-eval's, datasets', ours; Ray's workers inherit TQDM_DISABLE). Off: undo
    what on did."""
    if on:
        for name in ("ORCHARD_QUIET", "TQDM_DISABLE"):
            _SET.setdefault(name, os.environ.get(name))
            os.environ[name] = "1"
        _bars(False)
        return
    for name, before in _SET.items():
        os.environ.pop(name, None) if before is None else os.environ.__setitem__(name, before)
    _SET.clear()
    _bars(True)


def _bars(shown: bool) -> None:
    """tqdm reads TQDM_DISABLE when it is imported: once it is (an in-process caller), every bar is turned off at
    its constructor instead (lm-eval's and datasets' bars are tqdm's subclasses)."""
    std = sys.modules.get("tqdm.std")
    if std is None:
        return
    own = std.tqdm.__dict__.get("_orchard_init")
    if shown and own is not None:
        std.tqdm.__init__ = own
        del std.tqdm._orchard_init
    elif not shown and own is None:
        init = std.tqdm.__init__

        def silent(self, *args, **kwargs):
            init(self, *args, **{**kwargs, "disable": True})

        std.tqdm._orchard_init, std.tqdm.__init__ = init, silent


def say(text: str) -> None:
    """One phase line on stderr (never stdout: it holds results only)."""
    if not quiet():
        print(PREFIX + text, file=sys.stderr, flush=True)


@contextmanager
def phase(text: str, after: float = 0.0):
    """`text` on stderr while the block runs: at once (or only once it has lasted `after` s); on a terminal a
    spinner with the seconds so far turns at the end of the line after 2 s, and the line ends with the time taken."""
    if quiet():
        yield
        return
    tty, done, start, shown = sys.stderr.isatty(), threading.Event(), time.monotonic(), threading.Event()

    def line() -> None:
        shown.set()
        print(PREFIX + text, file=sys.stderr, end="" if tty else "\n", flush=True)

    def show() -> None:
        if after:
            if done.wait(after):
                return  # over before it was worth a line
            line()
        turn = 0
        while tty and not done.wait(0.25):
            if time.monotonic() - start > 2:
                turn += 1
                print(f"\r{PREFIX}{text} {SPIN[turn % 4]} {time.monotonic() - start:.0f} s", end="", file=sys.stderr, flush=True)

    if not after:
        line()  # from this thread: in order with what the block prints
    spinner = threading.Thread(target=show, daemon=True, name="orchard-phase")
    spinner.start()
    try:
        yield
    finally:
        done.set()
        spinner.join()
        if tty and shown.is_set():
            print(f"\r{PREFIX}{text} ({time.monotonic() - start:.1f} s)\x1b[K", file=sys.stderr, flush=True)


def quiet_option(command, top: bool = False):
    """`--quiet` on a command (and on `driver` itself, `top`: which also ends an earlier in-process --quiet):
    no phase lines or progress bars; results and errors still show."""
    import click

    return click.option("--quiet", "-q", is_flag=True, expose_value=False, is_eager=True,
                        callback=lambda ctx, param, on: set_quiet(True) if on else top and set_quiet(False),
                        help="No phase lines or progress bars on stderr (results and errors still show).")(command)  # fmt: skip
