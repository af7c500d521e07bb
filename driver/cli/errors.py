"""How every error of `driver` reaches the user: one `Error:` line on stderr, exit 2 or 1, never a traceback."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import click

from cluster import failures
from cluster.embedded import session
from driver.checks import settings
from driver.checks.errors import BadUsage, one_line
from driver.lm import quiet


@contextlib.contextmanager
def usage_errors():
    """Settings errors are usage errors (exit 2)."""
    try:
        yield
    except settings.SettingError as e:
        raise BadUsage(str(e)) from None


class OneLineErrors(click.Group):
    """Click's group, but every error is `Error: <one line>` on stderr (a usage error adds one hint line), with
    exit code 2 for usage errors and 1 for the rest; never a traceback (ORCHARD_TRACEBACK=1 shows an
    unexpected one).

    Exit 2 when the command line itself is wrong (a flag's value, an unknown key or task name:
    `driver.checks.errors.BadUsage`, click's own errors), 1 when it names something that is not usable or
    something failed (a file, folder, model, cache, cluster, worker: `Refused` and every other error)."""

    def main(self, *args, **kwargs):  # type: ignore[override]
        quiet.install()
        with quiet.interrupts_told():
            try:
                return self._main(*args, **kwargs)
            except SystemExit as e:  # after a Ctrl-C, the cache closed and the line said: Ray ended without waiting
                if e.code == 130:
                    session.exit_interrupted()
                raise

    def _main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:
            _error(one_line(e.format_message()))
            if e.ctx is not None:
                click.echo(f"Try '{e.ctx.command_path} --help' for help.", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            _error(one_line(e.format_message()))
            sys.exit(e.exit_code)
        except click.Abort as e:  # click's word for a Ctrl-C (KeyboardInterrupt) before the command's own handling
            if isinstance(e.__context__, KeyboardInterrupt):  # as mid-run (`resumable`): exit 130
                click.echo("interrupted", err=True)
                sys.exit(130)
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except Exception as e:  # a bug: still one line, unless asked for the traceback
            if os.environ.get("ORCHARD_TRACEBACK"):
                raise
            detail = (str(e).strip().splitlines() or [""])[0]
            _error(f"internal error ({type(e).__name__}: {detail}); rerun with ORCHARD_TRACEBACK=1 for the traceback")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _error(message: str) -> None:
    failures.stop_forwarding()
    click.echo(f"Error: {message}", err=True)


@contextlib.contextmanager
def resumable(cache: str | os.PathLike):
    """Ctrl-C (or SIGTERM, driver.lm.quiet) stops the command in one line: what finished is in the cache."""
    try:
        yield
    except KeyboardInterrupt:
        from driver.lm.cache import FILE

        if (Path(cache) / FILE).is_file():  # name only a cache that exists
            click.echo(f"interrupted: finished requests are cached in {cache}; rerun the same command to resume", err=True)
        else:
            click.echo("interrupted: nothing was computed yet", err=True)
        raise SystemExit(130) from None
