"""Save and load plans: pure functions over metadata, no I/O, printable and testable alone."""
