"""Where a phase line lands among the rest of stderr (driver.lm.quiet): each starts a line of its own. On a
terminal a phase line stays open while its spinner turns, so whatever is written next (a warning while the workers
load, the next phase) first ends it; off a terminal it is one plain line, and a progress bar left showing (a
sweep's pass, kept until the next) does not swallow it. The stream is a StringIO that says it is a terminal: what
is tested is the text written, which is pure logic."""

from __future__ import annotations

import io
import re
import sys
import time

import pytest
from tqdm import tqdm

from driver.lm import quiet
from testbed.waiting import until


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal(monkeypatch):
    """A Terminal that becomes sys.stderr once the test starts (pytest's capture sets sys.stderr again after the
    fixtures run); quiet wraps it, and the original comes back after the test."""
    monkeypatch.delenv("ORCHARD_QUIET", raising=False)
    screen = Terminal()
    screen.monkeypatch = monkeypatch
    return screen


def _on(screen: Terminal) -> Terminal:
    screen.monkeypatch.setattr(sys, "stderr", screen)
    return screen


def _shown(text: str) -> list[str]:
    """Each line as a terminal leaves it: what follows its last carriage return, the time taken cut off."""
    return [line.split("\r")[-1].split(" (")[0] for line in text.split("\n") if line.split("\r")[-1]]


def test_on_a_terminal_whatever_is_written_next_ends_the_phase_line_first(terminal):
    _on(terminal)
    with quiet.phase("starting Ray: 2 workers"):
        print("warning: vm runs MLX on the reference BLAS", file=sys.stderr)
    text = terminal.getvalue()
    assert text.startswith("driver: starting Ray: 2 workers\rdriver: starting Ray: 2 workers (")
    assert "\x1b[K\nwarning: vm runs MLX on the reference BLAS\n" in text, repr(text)
    assert text.count("2 workers (") == 1  # ended once: the block's end adds nothing after the warning


def test_the_next_phase_line_ends_the_one_before(terminal):
    _on(terminal)
    with quiet.phase("opening M on this machine"):
        with quiet.phase("starting Ray: 1 worker"):
            pass
        quiet.say("loading M on 1 worker")
    assert _shown(terminal.getvalue()) == ["driver: opening M on this machine", "driver: starting Ray: 1 worker",
                                           "driver: loading M on 1 worker"]  # fmt: skip


def test_off_a_terminal_a_phase_is_one_plain_line(capsys, monkeypatch):
    monkeypatch.delenv("ORCHARD_QUIET", raising=False)
    with quiet.phase("starting Ray"):
        print("warning: w", file=sys.stderr)
    assert capsys.readouterr().err == "driver: starting Ray\nwarning: w\n"


def test_a_phase_with_after_shows_only_once_it_has_lasted_that_long(capsys, monkeypatch):
    monkeypatch.delenv("ORCHARD_QUIET", raising=False)
    with quiet.phase("indexing lm-eval's tasks", after=30.0):
        pass
    err = []
    with quiet.phase("waiting for the workers", after=0.05):  # the line comes from a timer thread: as soon as it runs
        until(lambda: err.append(capsys.readouterr().err) or "waiting" in "".join(err), 10, 0.05)
    assert "".join(err) + capsys.readouterr().err == "driver: waiting for the workers\n"


def test_a_phase_line_while_a_bar_shows_starts_a_line_of_its_own(capsys, monkeypatch):
    """Off a terminal tqdm leaves the cursor after its bar's last state: the sweep's next pass was said after it,
    on the same line ('... 74%]driver: sweep: 12 generate requests')."""
    monkeypatch.delenv("ORCHARD_QUIET", raising=False)
    bar = tqdm(total=4, desc="loglikelihood grid of 31 configurations")
    bar.update(4)
    quiet.say("sweep: 12 generate requests × 31 configurations")
    bar.close()
    assert "driver: sweep: 12 generate requests × 31 configurations" in capsys.readouterr().err.split("\n")


def test_quiet_says_nothing(capsys, monkeypatch):
    monkeypatch.setenv("ORCHARD_QUIET", "1")
    with quiet.phase("starting Ray"):
        quiet.say("loading")
    assert capsys.readouterr().err == ""


def test_a_phase_line_wider_than_the_terminal_has_no_spinner(terminal, monkeypatch):
    """Wrapped, its carriage return would go back to its last row only: each turn would leave a copy behind."""
    monkeypatch.setenv("COLUMNS", "40")
    _on(terminal)
    with quiet.phase("opening /a/long/path/to/a/model on this machine (MLX, its tokenizer)"):
        pass
    with quiet.phase("starting Ray: 1 worker"):
        pass
    assert terminal.getvalue().split("\n")[0] == "driver: opening /a/long/path/to/a/model on this machine (MLX, its tokenizer)"
    assert terminal.getvalue().split("\n")[1].startswith("driver: starting Ray: 1 worker\rdriver: starting Ray: 1 worker (")


def test_a_transient_phase_shows_on_a_terminal_while_it_lasts_and_is_erased(terminal, capsys, monkeypatch):
    """A check before Ray: a terminal shows it while it lasts (a refusal then stays the whole of stderr); off a
    terminal a check that passes says so with its time once it ends (issue 38.5), one that fails says nothing."""
    with quiet.phase("checking steer.yaml", after=0.05, transient=True):
        time.sleep(0.4)
    assert re.fullmatch(r"driver: checking steer\.yaml \(\d+\.\d s\)\n", capsys.readouterr().err)
    with pytest.raises(ValueError), quiet.phase("checking steer.yaml", after=0.05, transient=True):
        time.sleep(0.2)
        raise ValueError("refused")
    assert capsys.readouterr().err == ""
    _on(terminal)
    with quiet.phase("checking steer.yaml", after=0.05, transient=True):
        until(lambda: "checking" in terminal.getvalue(), 10, 0.05)  # shown by a timer thread, however loaded the machine
    print("Error: steer.yaml: ...", file=sys.stderr)
    assert terminal.getvalue() == "driver: checking steer.yaml\r\x1b[KError: steer.yaml: ...\n"
