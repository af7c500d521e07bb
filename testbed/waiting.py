"""Waiting in a test for what other processes do (exit, release, clean up): poll until it has happened or a
generous deadline passes, instead of sleeping a fixed time (too short on a loaded machine, wasted on an idle one)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until(ready: Callable[[], T], seconds: float = 60.0, every: float = 0.1) -> T:
    """`ready()` once it is true, or its value when `seconds` have passed: assert on what it returns."""
    deadline = time.monotonic() + seconds
    while not (found := ready()) and time.monotonic() < deadline:
        time.sleep(every)
    return found


def until_empty(look: Callable[[], T], seconds: float = 60.0, every: float = 0.1) -> T:
    """`look()` once it is empty (falsy), or its value when `seconds` have passed: assert on what it returns."""
    deadline = time.monotonic() + seconds
    while (found := look()) and time.monotonic() < deadline:
        time.sleep(every)
    return found
