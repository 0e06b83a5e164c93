"""The ``TENSORPAR_*`` environment variables that change how ranks run, each read by one checked
reader: a bad value is a ``ValueError`` naming the variable, its value and the valid choices.

Read when used, never at import (a bad value must not make ``import tensorpar.distributed`` fail with a
traceback), and all checked by :func:`check_all`, which the launcher calls before any rank
starts: a rank that met the bad value later would fail after its peers had started. Stdlib only:
the shared-memory backend, the flight recorder and the rendezvous all read through here.
"""
from __future__ import annotations

import math
import os

# Slots of the shared-memory transport: whole pages, so that every dtype's view of a slot is
# aligned; at most 1 GiB per rank (a segment holds one slot per rank).
_PAGE = 4096
_MAX_SLOT = 1 << 30


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def _bad(name: str, value: str, valid: str) -> ValueError:
    return ValueError(f"environment variable {name}={value!r} is not valid; valid: {valid}")


def _choice(name: str, choices: tuple, default: str) -> str:
    value = _raw(name).lower()
    if not value:
        return default
    if value not in choices:
        raise _bad(name, os.environ[name], ", ".join(choices) + " (or unset)")
    return value


def _seconds(name: str, default: float | None, minimum: float) -> float | None:
    raw = _raw(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= minimum):
        raise _bad(name, os.environ[name], f"a number of seconds >= {minimum:g} (or unset)")
    return value


def _integer(name: str, default: int | None, low: int, high: int, step: int = 1) -> int | None:
    raw = _raw(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high or value % step:
        multiple = f"a multiple of {step} " if step > 1 else "an integer "
        raise _bad(name, os.environ[name], f"{multiple}from {low} to {high} (or unset)")
    return value


def transport() -> str:
    """``TENSORPAR_TRANSPORT``: ``"shm"`` (default: shared memory where a group's ranks share a
    host) or ``"gloo"`` (shared memory off)."""
    return _choice("TENSORPAR_TRANSPORT", ("shm", "gloo"), "shm")


def shm_slot_bytes() -> int:
    """``TENSORPAR_SHM_SLOT_BYTES``: bytes of each rank's shared-memory slot (default 1 MiB)."""
    return _integer("TENSORPAR_SHM_SLOT_BYTES", 1 << 20, _PAGE, _MAX_SLOT, _PAGE)


def check_collectives() -> bool:
    """``TENSORPAR_CHECK_COLLECTIVES``: ``1`` turns the rank-side signature check on, ``0`` off."""
    return _choice("TENSORPAR_CHECK_COLLECTIVES", ("0", "1"), "0") == "1"


def rendezvous() -> str:
    """``TENSORPAR_RENDEZVOUS``: what a launch does with torchrun's variables (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) set without torchrun's agent: ``"env"``
    joins the job they describe, ``"local"`` ignores them and starts local ranks; unset, such a
    launch is refused at once (:mod:`tensorpar.distributed.rendezvous`)."""
    return _choice("TENSORPAR_RENDEZVOUS", ("env", "local"), "")


def rendezvous_timeout() -> float:
    """``TENSORPAR_RENDEZVOUS_TIMEOUT``: seconds the ranks of an env:// job started without
    torchrun's agent wait for each other (default 30)."""
    return _seconds("TENSORPAR_RENDEZVOUS_TIMEOUT", 30.0, 0.1)


def max_local_ranks() -> int | None:
    """``TENSORPAR_MAX_LOCAL_RANKS``: the most ranks one launch may start on this machine,
    replacing the CPU and memory rule of :func:`tensorpar.distributed.preflight.check_local_world`."""
    return _integer("TENSORPAR_MAX_LOCAL_RANKS", None, 1, 1 << 20)


def unresponsive_timeout() -> float | None:
    """``TENSORPAR_UNRESPONSIVE_TIMEOUT``: seconds a rank may be stopped or silent before the
    launch ends (default: :mod:`tensorpar.distributed.liveness`'s bounds; raise it to attach a debugger)."""
    return _seconds("TENSORPAR_UNRESPONSIVE_TIMEOUT", None, 3.0)


def start_method() -> str:
    """``TENSORPAR_START_METHOD``: how local ranks are started: ``forkserver`` (default: forked
    from a server process that imported torch once) or ``spawn`` (a fresh interpreter per rank)."""
    return _choice("TENSORPAR_START_METHOD", ("forkserver", "spawn"), "forkserver")


def host_memory() -> str:
    """``TENSORPAR_HOST_MEMORY``: ``keep`` (default: a rank keeps the host memory it frees for its
    next allocation, :mod:`tensorpar.distributed.host_memory`) or ``system`` (the C library's
    defaults: freed blocks go back to the kernel and come back as page faults)."""
    return _choice("TENSORPAR_HOST_MEMORY", ("keep", "system"), "keep")


def traceback() -> bool:
    """``TENSORPAR_TRACEBACK``: ``1`` makes the command line print a failed rank's traceback."""
    return _choice("TENSORPAR_TRACEBACK", ("0", "1"), "0") == "1"


READERS = (transport, shm_slot_bytes, check_collectives, rendezvous, rendezvous_timeout, max_local_ranks,
           unresponsive_timeout, start_method, host_memory, traceback)


def check_all() -> None:
    """Every variable above, read once: the first bad one raises."""
    for read in READERS:
        read()
