"""``python -m specgate``: the ``specgate`` command."""

from specgate.cli import main

main()
