"""Terminal output: a spinner on stderr while a long step runs (never on stdout, which --json
keeps clean), and the console reports print to."""
from __future__ import annotations

import contextlib
import os
import sys


def reporting_rank() -> bool:
    """False in the processes of a torchrun job other than global rank 0: one report per job."""
    return os.environ.get("RANK", "0") == "0"


def console(**kw):
    """A rich console on stdout; 120 columns when stdout is not a terminal (``make run``, a pipe),
    where rich would otherwise wrap every table at 80. ``kw``: more ``Console`` options."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120, **kw)


@contextlib.contextmanager
def status(message: str, *, quiet: bool = False):
    if quiet:
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield
