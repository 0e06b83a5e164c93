"""Bytes on the wire: what this process's TCP sockets really sent and received.

The ledger's ``bytes_sent`` is the ring formula applied to each recorded call (the same formula
the planner predicts with), so "ledger equals planner" checks the calls and their sizes, not the
traffic. This module reads the kernel's own per-socket counters (Linux ``TCP_INFO``:
``tcpi_bytes_sent - tcpi_bytes_retrans + tcpi_notsent_bytes``, i.e. every byte the process handed
to TCP, once, whether or not it has left yet, and ``tcpi_bytes_received``) summed over the
process's TCP sockets, which on gloo are the connections to the peer ranks. A ledger opened with
``wire=True`` samples them around each synchronous collective (see
:func:`tensorpar.distributed.ledger.ledger`).

What is counted: payload plus gloo's per-message framing (tens of bytes per message) and, at small
sizes, whatever the backend's algorithm really sends (it need not be the ring). The bytes *sent*
in a call are exact: this rank writes them between the two samples. The bytes *received* are
indicative only: a faster peer may already be sending the next call's data, and the counters
are the process's, so another group's traffic in flight at the same time counts too. What is not
seen: traffic that does not go through this process's TCP sockets (NCCL over NVLink or
InfiniBand, shared memory), so :func:`available` is False there and the wire columns read
``None``. Cost: one ``getsockopt`` per socket and a scan of ``/proc/self/fd`` per sample (about
70-150 microseconds on this 2-core machine with 4 ranks); nothing when no ledger asks for it.
"""
from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys

# struct tcp_info offsets (include/uapi/linux/tcp.h): stable ABI, appended to only.
_BYTES_RECEIVED = 128  # __u64 tcpi_bytes_received (Linux 4.1)
_NOTSENT = 144  # __u32 tcpi_notsent_bytes (Linux 4.6)
_BYTES_SENT = 200  # __u64 tcpi_bytes_sent (Linux 4.19), retransmissions included
_BYTES_RETRANS = 208  # __u64 tcpi_bytes_retrans (Linux 4.19)
_INFO_LEN = 216


_LIBC = None


def _tcp_info(fd: int) -> bytes | None:
    """``getsockopt(fd, IPPROTO_TCP, TCP_INFO)`` through libc: no Python socket object is made on
    the backend's descriptor (one would set it non-blocking under ``socket.setdefaulttimeout``);
    a socket that is not TCP (a Unix socket) answers with an error and is skipped."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)
    size = ctypes.c_uint32(256)
    if _LIBC.getsockopt(fd, socket.IPPROTO_TCP, socket.TCP_INFO, buf, ctypes.byref(size)) != 0:
        return None
    return buf.raw[:size.value] if size.value >= _INFO_LEN else None


def _socket_fds() -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.append(int(name))
        except OSError:  # closed since the listing
            continue
    return fds


def counters() -> tuple[int, int] | None:
    """``(bytes handed to TCP, bytes received)`` over this process's TCP sockets, or None where the
    kernel does not report them (not Linux, or a kernel before 4.19)."""
    if not sys.platform.startswith("linux"):
        return None
    sent = received = 0
    found = False
    for fd in _socket_fds():
        info = _tcp_info(fd)
        if info is None:
            continue
        found = True
        sent += (struct.unpack_from("Q", info, _BYTES_SENT)[0] - struct.unpack_from("Q", info, _BYTES_RETRANS)[0]
                 + struct.unpack_from("I", info, _NOTSENT)[0])
        received += struct.unpack_from("Q", info, _BYTES_RECEIVED)[0]
    return (sent, received) if found else None


def available(backend: str) -> bool:
    """Whether a collective of ``backend`` travels over this process's TCP sockets and the kernel counts it."""
    return backend == "gloo" and counters() is not None
