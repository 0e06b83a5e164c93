"""A rank keeps the host memory it frees, instead of handing it back to the kernel every step.

glibc's ``malloc`` hands freed memory back to the kernel: blocks from 128 KiB up are ``mmap``-ed
and unmapped when freed (the threshold rises with use, to at most 32 MiB), and the heap is
trimmed whenever more than twice the threshold is free at its top. A training step frees its
activations and gradients and allocates them again in the next; each page handed back is a page
fault and a zeroed page when it returns. Measured on this project's 2-vCPU VM (``ru_minflt``
around each step of the estimates suite's ~25M-parameter Llama, 2 ranks, after warm-up;
tools/host_memory_bench.py): 79-83 MB of faults in each DDP step and 93-101 MB in each FSDP step;
0-0.2 MB once the rank keeps its memory.
PyTorch's CPU tuning guides remove the same waste by preloading jemalloc or tcmalloc with decay
off; glibc does it through ``mallopt``, with nothing to install.

:func:`keep_freed_memory` (each rank of :func:`~tensorpar.distributed.launch` and of
:func:`~tensorpar.distributed.init_from_env` calls it) fixes the threshold at 32 MiB from the start
and never trims the heap: what a rank frees stays in the process for its next allocation, and its
resident memory stays at its peak, as a GPU's caching allocator holds its pool. Blocks over 32 MiB
are still mapped and unmapped each time: a heap holding blocks that large fragments (PyTorch's
64-byte-aligned blocks do not fit back in their own freed space; measured, a loop over a 200 MB
tensor grew the heap by 1.6 GB). ``TENSORPAR_HOST_MEMORY=system`` leaves glibc's defaults; on a C
library without ``mallopt`` (musl, macOS) nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util

from tensorpar.distributed import settings

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_BYTES = 32 << 20  # blocks up to it come from the heap: the most glibc's own threshold rises to
TRIM_BYTES = (1 << 31) - 1  # the largest an int takes: in effect, never trim

_applied: str | None = None  # what this process set: "keep", or None


def keep_freed_memory() -> bool:
    """Set this process's allocator to keep freed memory (see the module docstring); ``True``
    where it did (or had), ``False`` where ``TENSORPAR_HOST_MEMORY=system`` or the C library has
    no ``mallopt`` or refuses it (glibc refuses neither value; should the second be refused, the
    threshold stays set, which only makes blocks up to 32 MiB come from the heap)."""
    global _applied
    if settings.host_memory() != "keep":
        return False
    if _applied == "keep":
        return True
    mallopt = _mallopt()
    if mallopt is None:
        return False
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)):
        return False
    _applied = "keep"
    return True


def _mallopt():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        fn = libc.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # musl's mallopt is a stub that returns 0: keep_freed_memory then says False, as it should
    return fn
