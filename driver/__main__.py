"""`python -m driver ...` is the `driver` command."""

from driver.cli import main

main()
