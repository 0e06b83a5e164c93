"""How a command fails: one line on stderr, an exit code, and with ``--json`` one JSON object on
stdout (what a script parses). Every command's failure goes through :func:`fail`."""
from __future__ import annotations

import json
import sys


def fail(args, message: str, code: int) -> int:
    """One line on stderr naming the command; with ``--json``, ``{"ok": false, ...}`` on stdout."""
    sys.stderr.write(f"tensorpar {args.command}: error: {message}\n")
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": message, "exit_code": code}))
    return code


def one_line(exc) -> str:
    """An exception's message on one line (a message may carry newlines), else its type's name."""
    return " ".join(str(exc).split()) or type(exc).__name__
