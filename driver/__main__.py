"""`python -m driver ...` is the `driver` command."""

from .cli import main

main()
