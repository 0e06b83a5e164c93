"""`tensorpar run | train | verify | plan | bench | demo`: the only place that prints.

Each sub-command lives in its own module with ``add_parser(subparsers)`` and ``main(args) -> int``.
Errors a user can cause are raised as ``ValueError`` (or ``FileNotFoundError``) by the library and
turned here into one line on stderr and exit code 2; a failed rank or a launch past its deadline
into one line naming the rank, exit code 1; Ctrl-C into one line, exit code 130. With ``--json``
each also prints ``{"ok": false, "error": ..., "exit_code": ...}`` on stdout.
"""
from __future__ import annotations

import argparse
import os
import sys

from tensorpar import __version__
from tensorpar.cli import bench, calibrate, demo, plan, run, serve, train, verify
from tensorpar.cli.errors import fail, one_line

# Sub-commands in the order `--help` lists them; each is a module tensorpar/cli/<name>.py, imported
# above: its parser only (argparse, no torch, no numpy); it loads its job when it runs.
SUBCOMMANDS = ("run", "train", "verify", "plan", "calibrate", "bench", "serve", "demo")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other user error
        sys.stderr.write(f"tensorpar: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tensorpar", description="Tensor parallelism that states its costs, measures "
                     "them, and proves the split model computes the same function as the unsplit one.")
    parser.add_argument("--version", action="version", version=f"tensorpar {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name in SUBCOMMANDS:
        globals()[name].add_parser(sub)  # the sub-command's module, imported above by the same name
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, NotADirectoryError) as exc:
        return fail(args, one_line(exc), 2)
    except _launch_errors() as exc:  # a rank failed or the launch timed out: named, exit 1
        detail = str(exc).split("\n--- traceback on rank", 1)[0]
        wanted = os.environ.get("TENSORPAR_TRACEBACK") == "1"  # checked (0 or 1) before any rank started
        hint = "" if wanted else " (TENSORPAR_TRACEBACK=1 prints the rank's traceback)"
        if wanted:
            sys.stderr.write(getattr(exc, "remote_traceback", "") or "")
        return fail(args, one_line(detail) + hint, 1)
    except KeyboardInterrupt:
        return fail(args, "interrupted", 130)


def _launch_errors() -> tuple:
    """The launcher's errors, without importing torch for commands that never launch."""
    launcher = sys.modules.get("tensorpar.distributed.launcher")  # loaded by any command that launched ranks
    return () if launcher is None else (launcher.RankFailedError, launcher.LaunchTimeoutError)

