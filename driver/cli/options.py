"""One name per option in --help: the first long name is shown, the others (lm-eval's underscore spellings, another
command's name for the same thing) stay accepted as hidden aliases."""

from __future__ import annotations

import click


class Aliased(click.Option):
    """A click option whose --help shows its first long name (and its short one), not its aliases."""

    def get_help_record(self, ctx: click.Context):
        names = self.opts
        self.opts = [n for i, n in enumerate(names) if i == 0 or not n.startswith("--")]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = names


def hide_aliases(command: click.Command) -> None:
    """Every option of `command` (and of its subcommands) with several long names shows the first one only."""
    for sub in getattr(command, "commands", {}).values():
        hide_aliases(sub)
    for param in command.params:
        if type(param) is click.Option and sum(n.startswith("--") for n in param.opts) > 1:
            param.__class__ = Aliased
