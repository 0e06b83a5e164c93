"""What multiprocessing's fork server does differently when it imports this (the launcher's
:data:`~tensorpar.distributed.launcher.PRELOAD` list names it first): it ignores SIGTERM.

A SIGTERM sent to the launcher's whole process group (systemd stopping a service's control group,
``kill -TERM -PGID``, ``timeout``) is the launcher's to handle: it drains or stops its ranks. The
ranks are the server's children and die with it (``PR_SET_PDEATHSIG``), so a server that died of
the same signal would kill them first, and their exit status would be lost ("died with code 255").
The server still ends with the launcher: it exits when the launcher's end of its pipe closes. Each
rank restores SIGTERM's default action when it starts (``launcher._rank_main``).

Imported anywhere but in the fork server, this module does nothing: the server is told by its
command line.
"""
from __future__ import annotations

import signal
from pathlib import Path

SERVER_COMMAND = b"from multiprocessing.forkserver import main"


def _in_fork_server() -> bool:
    try:
        return SERVER_COMMAND in Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return False


if _in_fork_server():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
