"""Terminal output: the phases of a long command with their elapsed time, on stderr while they
run (never on stdout, which --json keeps clean; nothing at all when stderr is not a terminal, or
with --json), and the console reports print to."""
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


class Phases:
    """``with Phases(quiet) as phases: with phases("loading"): ...``: each phase a line on stderr
    with a spinner and its elapsed time while it runs, then a check mark and the time it took (a
    cross if it raised).
    Quiet (no output at all) when asked, when stderr is not a terminal (a pipe, a log file, CI) or
    on a torchrun process other than rank 0."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet or not sys.stderr.isatty() or not reporting_rank()
        self._progress = None

    def __enter__(self):
        if not self.quiet:
            from rich.console import Console
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(SpinnerColumn(finished_text="[green]✓[/]"), TextColumn("{task.description}"),
                                      TimeElapsedColumn(), console=Console(stderr=True))
            self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)
        return False

    @contextlib.contextmanager
    def __call__(self, text: str):
        if self._progress is None:
            yield
            return
        task = self._progress.add_task(text, total=1)
        try:
            yield
        except BaseException:  # a phase that failed is not shown done: a cross, and how long it ran
            elapsed = self._progress.tasks[task].elapsed or 0.0
            self._progress.remove_task(task)
            self._progress.console.print(f"[red]✗[/] {text} (failed after {elapsed:.1f} s)")
            raise
        self._progress.update(task, completed=1)
        self._progress.stop_task(task)
