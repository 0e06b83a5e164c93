"""A reaper for a launch: stops every rank's process group, and removes the rendezvous folder, if
the launcher dies without doing it.

Each rank asks the kernel to SIGKILL it when the launcher dies (``PR_SET_PDEATHSIG``), but what a
rank started (a subprocess, a shell) is not the launcher's child and would live on, and the
launcher's rendezvous folder would stay in the temporary directory. So each launch also starts a
small reaper process that reads, on a pipe from the launcher, the pid of every rank (each leads a
process group of its own) and the rendezvous folder. The launcher writes ``done`` once it has
stopped the ranks itself; if the pipe closes without it (the launcher was SIGKILLed or crashed),
the reaper SIGKILLs every group it was told about, removes the folder, and exits. It runs in a
session of its own and ignores SIGINT, SIGTERM and SIGHUP, so that a Ctrl-C, a ``kill`` of the
launcher's process group or a closed terminal does not take it down with the launcher: it always
ends when the pipe closes. Cost: one small Python process per launch (tens of milliseconds).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

_CODE = """
import os, shutil, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
pids, folders = [], []
for line in sys.stdin:
    kind, _, value = line.strip().partition(" ")
    if kind == "done":
        sys.exit(0)
    if kind == "pid" and value.isdigit():
        pids.append(int(value))
    if kind == "folder" and value:
        folders.append(value)
for pid in pids:
    try:
        os.killpg(pid, signal.SIGKILL)  # the rank's group: the rank and what it started
    except OSError:
        pass
for folder in folders:
    shutil.rmtree(folder, ignore_errors=True)
"""


class Reaper:
    """``folder(path)`` for the rendezvous folder, ``add(pid)`` for each rank started; ``done()``
    once the launcher has stopped them itself."""

    def __init__(self):
        self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CODE], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                                      close_fds=True, start_new_session=True)

    def folder(self, path: str) -> None:
        self._write(f"folder {path}\n")

    def add(self, pid: int) -> None:
        self._write(f"pid {pid}\n")

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


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead(folder: str, prefix: str, remove) -> None:
    """``remove(path)`` for every entry of ``folder`` named ``<prefix><pid>-...`` whose pid is gone:
    what a process SIGKILLed before cleaning up left behind (rendezvous folders, shared segments)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        m = re.match(rf"{re.escape(prefix)}(\d+)-", name)
        if m and not pid_alive(int(m.group(1))):
            remove(os.path.join(folder, name))
