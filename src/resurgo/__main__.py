"""``python -m resurgo``: the command line (see resurgo.cli)."""

from resurgo.cli import main

if __name__ == "__main__":
    main()
