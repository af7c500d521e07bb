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

from cluster.embedded import session  # imports no Ray

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


_INTERRUPTED = threading.Event()  # a Ctrl-C came during this command (interrupts_told)


def _interrupt(signum, frame) -> None:
    """Ctrl-C (and SIGTERM): said at once, then the command's Ctrl-C path: finished work kept, one line, and an
    embedded Ray's processes killed as the process exits (cluster.embedded.session.exit_interrupted; a graceful
    shutdown took 9-13 s). A second one stops at once: this process's Ray processes killed, exit 130.
    os.write: a print here could land inside another write to stderr."""
    if _INTERRUPTED.is_set() and signum == signal.SIGINT:
        os.write(2, b"\ninterrupted again: stopped at once, Ray's processes killed\n")
        session.end_now()
    _INTERRUPTED.set()
    session.interrupted()  # Ray ended at the exit, not shut down gracefully (seconds)
    if not quiet():
        os.write(2, b"\ndriver: interrupted: stopping (Ctrl-C again stops at once)\n")
    raise KeyboardInterrupt


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
    _cleared_when_done()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


@contextmanager
def interrupts_told():
    """Ctrl-C said at once while a command runs (`_interrupt`); the handler before it back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, _interrupt)
    _INTERRUPTED.clear()
    session.interrupted(False)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


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


def _cleared_when_done() -> None:
    """On a terminal, the bars of each lm-eval pass (a task's contexts, Tokenizing) are cleared when done: a sweep
    runs one pass per configuration, and their finished bars filled the screen (off one, a log keeps them)."""
    import tqdm.std

    if not sys.stderr.isatty() or "_orchard_cleared" in tqdm.std.tqdm.__dict__:
        return
    init = tqdm.std.tqdm.__init__

    def cleared(self, *args, **kwargs):
        desc = str(kwargs.get("desc") or "")
        init(self, *args, **({"leave": False} if desc == "Tokenizing" or desc.endswith("contexts") else {}) | kwargs)

    tqdm.std.tqdm.__init__, tqdm.std.tqdm._orchard_cleared = cleared, True


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

_MEANWHILE: list[str | None] = ["lm-eval builds its requests"]  # what the head does while the workers load


def meanwhile() -> str:
    """' (lm-eval builds its requests meanwhile)' for the phase line of the workers loading; '' when nothing is."""
    return f" ({_MEANWHILE[-1]} meanwhile)" if _MEANWHILE[-1] else ""


@contextmanager
def doing_meanwhile(what: str | None):
    """What `meanwhile` says inside the block (None: nothing; `driver vectors` builds no lm-eval requests)."""
    _MEANWHILE.append(what)
    try:
        yield
    finally:
        _MEANWHILE.pop()


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


_OPEN: list = []  # how to end the phase line open on a terminal (its spinner turning), when one is
_OPEN_LOCK = threading.Lock()


def _end_open_line() -> None:
    """A phase line lasts until the next one, or until anything else is written: end it (its time taken)."""
    with _OPEN_LOCK:
        ends, _OPEN[:] = list(_OPEN), []
    for end in ends:
        end()


class _EndsOpenLine:
    """sys.stderr on a terminal: whatever is written while a phase line is open (a warning as the workers load,
    the next phase) first ends that line, so it starts a line of its own instead of trailing the spinner."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        if text:
            _end_open_line()
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _terminal():
    """The terminal stderr writes to, or None off a terminal (sys.stderr then wrapped once, _EndsOpenLine)."""
    err = sys.stderr
    if isinstance(err, _EndsOpenLine):
        return err.stream
    if not err.isatty():
        return None
    sys.stderr = _EndsOpenLine(err)
    return err


def _open_bars() -> bool:
    """Whether a progress bar is showing (a sweep's pass keeps its bar until the next pass starts)."""
    std = sys.modules.get("tqdm.std")
    return std is not None and bool(list(getattr(std.tqdm, "_instances", ())))


def _fits(text: str) -> bool:
    """Whether the phase line and its spinner fit on one row of the terminal: a wrapped line's carriage return
    would go back to its last row only, and each turn of the spinner would leave a copy of the rest behind."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        try:
            columns = os.get_terminal_size(sys.stderr.fileno()).columns  # stderr's: stdout may go to a file
        except (OSError, ValueError, AttributeError):
            columns = 80
    return len(PREFIX + text) + len(" | 999 s") < columns


_FINISHED: list = []  # weak references to what ends a finished progress bar (driver.lm.progress)


def end_when_finished(method) -> None:
    """`method()` ends its progress bar if it is finished: called before each phase line, so that a finished bar
    stays above the line after it instead of being drawn again below it."""
    import weakref

    _FINISHED[:] = [ref for ref in _FINISHED if ref() is not None] + [weakref.WeakMethod(method)]


def _write(line: str) -> None:
    """A line of its own on stderr: a progress bar showing is cleared and drawn again below it on a terminal; off
    one, the bar's last state keeps its line (tqdm leaves the cursor after it)."""
    for ref in list(_FINISHED):
        if (end := ref()) is not None:
            end()
    if _open_bars() and _terminal() is not None:
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)
        return
    print("\n" * _open_bars() + line, file=sys.stderr, flush=True)


def say(text: str) -> None:
    """One phase line on stderr (never stdout: it holds results only); it ends the phase line before it."""
    if not quiet():
        _end_open_line()
        _write(PREFIX + text)


@contextmanager
def phase(text: str, after: float = 0.0, transient: bool = False):
    """`text` on stderr while the block runs: at once (or only once it has lasted `after` s); on a terminal a
    spinner with the seconds so far turns at the end of the line after 2 s, and the line ends with the time taken
    when the block ends, or as soon as the next phase line or anything else is written to stderr. `transient`: a
    check before Ray: on a terminal erased when it ends, off one said when it passed (with its time), so that a
    refusal stays the whole of stderr."""
    tty = None if quiet() or _open_bars() or not _fits(text) else _terminal()  # a spinner beside a bar would write into it
    if quiet() or (transient and tty is None):
        start = time.monotonic()
        yield  # off a terminal a check is told once it passed, with its time: a refusal stays the whole of stderr
        if transient and not quiet() and time.monotonic() - start >= after:
            _write(f"{PREFIX}{text} ({time.monotonic() - start:.1f} s)")
        return
    _end_open_line()
    done, shown, start, lock = threading.Event(), threading.Event(), time.monotonic(), threading.Lock()

    def end() -> None:
        with lock:
            if tty and shown.is_set() and not done.is_set():
                ending = "" if transient else f"{PREFIX}{text} ({time.monotonic() - start:.1f} s)"
                print(f"\r{ending}\x1b[K", file=tty, end="" if transient else "\n", flush=True)
            done.set()

    def line() -> None:
        with lock:
            if done.is_set():
                return
            shown.set()
            if tty is None:
                return _write(PREFIX + text)
            print(PREFIX + text, file=tty, end="", flush=True)
            with _OPEN_LOCK:
                _OPEN.append(end)

    def show() -> None:
        if after and not done.wait(after):
            line()
        while tty and not done.wait(0.25):
            with lock:
                if shown.is_set() and not done.is_set() and time.monotonic() - start > 2:
                    print(f"\r{PREFIX}{text} {SPIN[int(time.monotonic() * 4) % 4]} {time.monotonic() - start:.0f} s",
                          end="", file=tty, flush=True)  # fmt: skip

    if not after:
        line()  # from this thread: in order with what the block prints
    spinner = threading.Thread(target=show, daemon=True, name="orchard-phase")
    spinner.start()
    try:
        yield
    finally:
        with _OPEN_LOCK:
            if end in _OPEN:
                _OPEN.remove(end)
        end()
        spinner.join()


def quiet_option(command, top: bool = False):
    """`--quiet` on a command (and on `driver` itself, `top`: which also ends an earlier in-process --quiet):
    no phase lines or progress bars; results and errors still show."""
    import click

    return click.option("--quiet", "-q", is_flag=True, expose_value=False, is_eager=True,
                        callback=lambda ctx, param, on: set_quiet(True) if on else top and set_quiet(False),
                        help="No phase lines or progress bars on stderr (results and errors still show).")(command)  # fmt: skip
