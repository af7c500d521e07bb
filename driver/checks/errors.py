"""The two ways a check fails, in one line: `Refused` (exit 1) and `BadUsage` (exit 2)."""

from __future__ import annotations

import click


class Refused(click.ClickException):
    """Something the command names is not usable (exit 1); one line."""

    exit_code = 1


class BadUsage(click.ClickException):
    """The command line itself is wrong (exit 2); one line."""

    exit_code = 2


def one_line(message: object) -> str:
    """A message on one line: every run of whitespace (newlines too) becomes one space."""
    return " ".join(str(message).split())
