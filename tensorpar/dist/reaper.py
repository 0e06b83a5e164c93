"""A reaper for a launch: stops every rank's process group if the launcher dies without doing it.

Each rank asks the kernel to SIGKILL it when the launcher dies (``PR_SET_PDEATHSIG``), but what a
rank started (a subprocess, a shell) is not the launcher's child and would live on. So each launch
also starts a small reaper process that reads, on a pipe from the launcher, the pid of every rank
(each leads a process group of its own). The launcher writes ``done`` once it has stopped the
ranks itself; if the pipe closes without it (the launcher was SIGKILLed or crashed), the reaper
SIGKILLs every group it was told about, and exits. It ignores SIGINT and SIGTERM, which a
terminal or a ``kill`` of the whole group would send it too early: it always ends when the pipe
closes. Cost: one small Python process per launch (tens of milliseconds to start).
"""
from __future__ import annotations

import subprocess
import sys

_CODE = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pids = []
for line in sys.stdin:
    line = line.strip()
    if line == "done":
        sys.exit(0)
    if line.isdigit():
        pids.append(int(line))
for pid in pids:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


class Reaper:
    """``add(pid)`` for each rank started; ``done()`` once the launcher has stopped them itself."""

    def __init__(self):
        self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CODE], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                                      close_fds=True)

    def add(self, pid: int) -> None:
        self._write(f"{pid}\n")

    def done(self) -> None:
        self._write("done\n")
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _write(self, text: str) -> None:
        try:
            self._proc.stdin.write(text)
            self._proc.stdin.flush()
        except (OSError, ValueError):  # the reaper is gone: nothing to tell it
            pass
