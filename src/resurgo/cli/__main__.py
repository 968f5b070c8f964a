"""``python -m resurgo.cli``: the same as ``resurgo`` and ``python -m resurgo``."""

from resurgo.cli.app import main

main()
