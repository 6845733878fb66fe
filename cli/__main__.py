"""`python -m cli ...`: the `quantgate` command from a checkout (the same as the installed script)."""

from cli.main import main

main()
