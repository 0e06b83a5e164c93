"""A spinner on stderr while a long step runs (never on stdout, which --json keeps clean)."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def status(message: str, *, quiet: bool = False):
    if quiet:
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield
