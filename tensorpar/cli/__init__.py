"""`tensorpar run | verify | plan | bench | demo`: the only place that prints.

Each sub-command lives in its own module with ``add_parser(subparsers)`` and ``main(args) -> int``.
Errors a user can cause are raised as ``ValueError`` (or ``FileNotFoundError``) by the library and
turned here into one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Sub-commands in the order `--help` lists them; each is a module tensorpar/cli/<name>.py.
SUBCOMMANDS = ("run", "verify", "plan", "bench", "demo")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other user error
        sys.stderr.write(f"tensorpar: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tensorpar", description="Tensor parallelism that states its costs, measures "
                     "them, and proves the split model computes the same function as the unsplit one.")
    from tensorpar import __version__

    parser.add_argument("--version", action="version", version=f"tensorpar {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"tensorpar.cli.{name}")
        module.add_parser(sub)
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
        sys.stderr.write(f"tensorpar {args.command}: error: {_one_line(exc)}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("tensorpar: interrupted\n")
        return 130


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
