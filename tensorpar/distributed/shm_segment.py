"""A shared-memory segment for the ranks of one group on one host, and how they wait on it.

Layout: one 128-byte line of flags per rank (``arrive`` at byte 0, the round's *signature* — an
op code and a byte count — at bytes 32 and 36, ``depart`` at byte 64: each int32 is written by
its rank only, so no atomic read-modify-write is needed), then one data slot of ``slot_bytes``
per rank. A rank compares its peers' signatures with its own once they arrive: ranks in
different collectives, or in one of different sizes (which gloo would report or hang on), raise
:class:`~tensorpar.distributed.flight.CollectiveMismatchError` naming both instead of reading each
other's bytes. A collective is a sequence of *rounds*; in round ``g`` a rank waits
until every peer has left round ``g - 1`` (its slot may be overwritten), writes its slot, sets
``arrive = g``, waits until every peer has arrived, reads what it needs from the slots and sets
``depart = g``. Ordering relies on x86-64's total store order (a flag stored after the data is
seen after it); :func:`usable` refuses other architectures.

Waiting: a short spin (only when the group has a core per rank), then ``futex(FUTEX_WAIT)`` on
the flag in slices of 50 ms, so a rank waiting long sleeps in the kernel instead of spinning a
core; the writer of a flag wakes its waiters with ``FUTEX_WAKE``. Between slices the waiter
checks the collective's timeout and that every peer process is still alive, and raises
:class:`ShmPeerError` naming the rank otherwise.

The file is created ``0600`` (readable by its owner only) under ``/dev/shm`` with its creator's
pid in its name, its pages reserved with ``posix_fallocate`` (a full ``/dev/shm`` is an error at
creation, not a SIGBUS later), and unlinked by the creator as soon as every rank has mapped it:
from then on nothing is left in ``/dev/shm`` whatever happens to the ranks. A segment whose
creator died before that point (its pid is in the name) is removed by :func:`sweep_stale`, which
the launcher runs once it has stopped its ranks, and every creation runs too.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import stat
import time

import torch

from tensorpar.distributed.flight import CollectiveMismatchError
from tensorpar.distributed.reaper import pid_alive, sweep_dead

SHM_DIR = "/dev/shm"
PREFIX = "tensorpar-shm-"
_LINE = 128  # bytes per rank of flags: arrive at +0, depart at +64 (separate cache lines)
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # x86-64 syscall number; shared (not PRIVATE) ops
_SLICE_S = 0.05
_MASK = 0x7FFFFFFF

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_int]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_SLICE = _Timespec(0, int(_SLICE_S * 1e9))


OPS = ("barrier", "all_reduce", "all_gather", "reduce_scatter", "broadcast")


_REDUCTIONS = ("sum", "product", "max", "min", "avg", "band", "bor", "bxor")  # shm._REDUCE's order
_EXTRA = {1: _REDUCTIONS, 3: _REDUCTIONS}


def _describe(code: int, nbytes: int) -> str:
    op, extra = code % 8, code // 8
    name = OPS[op] if op < len(OPS) else f"op {op}"
    if op in _EXTRA:
        name += f" ({_EXTRA[op][extra] if extra < len(_EXTRA[op]) else extra})"
    elif op == 4:
        name += f" from rank {extra}"
    return f"{name} of {nbytes} B" if op else name


class ShmPeerError(RuntimeError):
    """A peer of a shared-memory group died or did not arrive within the collective's timeout."""


def usable() -> str | None:
    """None if this machine can run the transport, else why not."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the shared-memory transport relies on x86-64 memory ordering; this is {platform.machine()}"
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is not a writable directory"
    return None


def host_identity() -> str:
    """Equal on two processes that can share a segment and see each other's pids."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        boot, pidns = "?", "?"
    return f"{platform.node()}|{boot}|{pidns}|{os.stat(SHM_DIR).st_dev if os.path.isdir(SHM_DIR) else '?'}"


def sweep_stale() -> None:
    """Remove segments whose creating process is gone (it died before unlinking them)."""
    sweep_dead(SHM_DIR, PREFIX, _unlink_quietly)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class Segment:
    """The mapped segment of one group, seen from ``rank`` of ``size``."""

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, create: bool):
        self.path, self.rank, self.size, self.slot_bytes = path, rank, size, slot_bytes
        data_at = -(-size * _LINE // 4096) * 4096
        total = data_at + size * slot_bytes
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
        else:
            fd = os.open(path, os.O_RDWR)
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077 or info.st_size != total:
                os.close(fd)
                raise OSError(f"{path} is not a segment this user made for this group")
        try:
            self._map = mmap.mmap(fd, total)
        except OSError:
            if create:
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._flags = (ctypes.c_int32 * (data_at // 4)).from_buffer(self._map)  # keeps the map alive
        self._base = ctypes.addressof(self._flags)
        data = torch.frombuffer(self._map, dtype=torch.uint8, offset=data_at, count=size * slot_bytes)
        self.slots = list(data.view(size, slot_bytes))  # rank r's slot: (slot_bytes,) uint8
        self.round = 0
        self.peer_pids: list[int] = []
        self.timeout_s = 1800.0
        self.spin = 0
        self.broken = ""  # why the group failed, once it has
        self._typed: dict = {}

    def typed(self, dtype: torch.dtype) -> list:
        """Every rank's slot as a flat tensor of ``dtype`` (made once per dtype)."""
        views = self._typed.get(dtype)
        if views is None:
            with torch.inference_mode(False):  # made under inference mode, a view could not be written outside it
                views = self._typed[dtype] = [slot.view(dtype) for slot in self.slots]
        return views

    # flag indices (int32 units): arrive of r, depart of r
    def _arrive(self, r: int) -> int:
        return r * _LINE // 4

    def _depart(self, r: int) -> int:
        return r * _LINE // 4 + 16

    def begin(self) -> int:
        """Start the next round: wait until every peer has left the previous one; returns its number."""
        if self.broken:  # the ranks' rounds no longer line up: as a failed communicator, it stays failed
            raise ShmPeerError(f"this shared-memory group failed earlier ({self.broken}); it cannot be used again")
        g = (self.round + 1) & _MASK
        for r in range(self.size):
            self._wait(self._depart(r), self.round, r, "leave the previous collective")
        return g

    def arrive(self, g: int, op: int = 0, nbytes: int = 0, extra: int = 0) -> None:
        """This rank's slot is written: tell the peers, and wait until they all have written theirs
        with the same signature: ``op`` code, the collective's total ``nbytes`` and ``extra`` (the
        reduction, the broadcast's root)."""
        me = self._arrive(self.rank)
        op = op + 8 * extra
        self._flags[me + 8], self._flags[me + 9] = op, nbytes & _MASK
        self._set(me, g)
        for r in range(self.size):
            self._wait(self._arrive(r), g, r, "arrive")
        for r in range(self.size):
            theirs = (self._flags[self._arrive(r) + 8], self._flags[self._arrive(r) + 9])
            if theirs != (op, nbytes & _MASK):
                self.broken = (f"ranks {self.rank} and {r} of a shared-memory group issued different collectives: "
                               f"rank {self.rank} {_describe(op, nbytes)}, rank {r} {_describe(*theirs)}")
                raise CollectiveMismatchError(self.broken)

    def depart(self, g: int) -> None:
        self._set(self._depart(self.rank), g)
        self.round = g

    def _set(self, index: int, value: int) -> None:
        self._flags[index] = value
        _syscall(_SYS_FUTEX, self._base + 4 * index, _FUTEX_WAKE, _MASK, None, None, 0)

    def _wait(self, index: int, target: int, peer: int, what: str) -> None:
        flags = self._flags
        if flags[index] == target:
            return
        for _ in range(self.spin):
            if flags[index] == target:
                return
        t0 = time.monotonic()
        while True:
            seen = flags[index]
            if seen == target:
                return
            _syscall(_SYS_FUTEX, self._base + 4 * index, _FUTEX_WAIT, seen, ctypes.byref(_SLICE), None, 0)
            if flags[index] == target:
                return
            waited = time.monotonic() - t0
            if waited > _SLICE_S:
                self._check_peer(peer, waited, what)

    def _check_peer(self, peer: int, waited: float, what: str) -> None:
        pid = self.peer_pids[peer] if self.peer_pids else None
        if pid is not None and not pid_alive(pid):
            self.broken = f"rank {peer} of the group (pid {pid}) is gone (Connection closed by peer)"
        elif waited > self.timeout_s:
            self.broken = f"timed out after {waited:.0f}s waiting for rank {peer} of the group to {what}"
        if self.broken:
            raise ShmPeerError(f"shared-memory collective: {self.broken}")
