"""The command line: ``resurgo inspect | verify | diff | ls | gc | convert | bench | study``.

``study`` runs the checkpointing study (``resurgo.study``) and writes its report. Every other
command reads only the manifest unless it has to read data (``verify``, ``ls --verify``),
never unpickles anything, and turns an error into a one-line red message on stderr (no
traceback). ``--json`` prints a machine-readable summary on stdout instead of the tables.

:mod:`resurgo.cli.app` holds the app and the exit codes, :mod:`resurgo.cli.render` what is shown,
and each command has its own module: it parses its options, calls the library, renders the result.
"""

from resurgo.cli.app import app, main

__all__ = ["app", "main"]
