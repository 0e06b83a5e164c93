"""What a checkpoint folder may contain, and whether a destination can take a write.

A checkpoint folder is not trusted: nothing in it may make tensorpar read, write or delete
outside it. ``latest`` must be a regular file naming a step folder of :mod:`tensorpar.models.saving`'s
own form (``step-NNNNNNNN`` or ``step-NNNNNNNN.<hex>``), never a path, and that folder and its
``COMPLETE`` record must be themselves, not symlinks. A destination (a checkpoint root, an export
folder) is checked before anything is written: a folder or a path that can become one, writable,
with room for what is to be written; a write that fills the disk is named (:class:`NoSpaceError`).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from tensorpar.distributed import dcp

LATEST, COMPLETE = "latest", "COMPLETE"
_STEP_FOLDER = re.compile(r"step-\d{8}(\.[0-9a-f]{8})?")  # what save names a step's folder, and nothing else


class NoSpaceError(OSError, ValueError):
    """The disk filled up while a checkpoint or export was written (an ``OSError`` with errno
    ``ENOSPC``, one line naming the folder; a ``ValueError`` too, as a bad destination is)."""


def check_writable(path, nbytes: int = 0) -> Path:
    """``path`` is a folder, or can be made one, that this process can write ``nbytes`` into:
    ``ValueError`` naming it and what is wrong otherwise (a file there, no permission, a
    read-only filesystem, too little free space). Creates nothing; for a training job to call
    before any rank starts, on its checkpoint and export folders. Returns the existing folder
    (``path`` or its nearest existing parent) whose filesystem was checked."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{str(p)!r} is a file, not a folder: a checkpoint or an export is a folder; give a path "
                         f"that is a folder or does not exist yet")
    base = next(a for a in (p, *p.absolute().parents) if a.exists())
    if not base.is_dir():
        raise ValueError(f"{str(p)!r} cannot be made a folder: {str(base)!r} is a file")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as exc:
        raise ValueError(f"{str(p)!r} is not writable: no file can be created in {str(base)!r} "
                         f"({exc.strerror})") from None
    check_room(p, nbytes, base)
    return base


def check_room(path: Path, nbytes: int, base: Path | None = None) -> None:
    """``nbytes`` fit in the free space of ``path``'s filesystem (``base``: its nearest existing folder)."""
    base = base or next(a for a in (path, *path.absolute().parents) if a.exists())
    free = shutil.disk_usage(base).free
    if nbytes > free:
        raise ValueError(f"{str(path)!r}: not enough free space: {nbytes} bytes to write ({nbytes / 2**20:.1f} MiB), "
                         f"{free} free on its filesystem ({free / 2**20:.1f} MiB)")


@contextlib.contextmanager
def writing(root: Path, partial: Path | None, largest: int = 0):
    """A write under ``root`` that fails for want of space or permission: one line naming it, the
    ``partial`` folder (this save's own) removed to give the space back. A full disk is known by
    its errno, or, where torch's writer reports it as its own error ("unexpected pos"), by less
    room left on the filesystem than the largest item (``largest`` bytes) and 1 MiB: the write
    that failed needed more. Any other failure (a rank lost) is raised as is, the unfinished
    folder left without its COMPLETE record, never read."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - diagnosed below, re-raised as is unless the disk is the cause
        code = getattr(exc, "errno", None)
        full = code in (errno.ENOSPC, errno.EDQUOT) or room_left(root) < largest + 2**20
        denied = code in (errno.EACCES, errno.EPERM, errno.EROFS)
        if not (full or denied):
            raise
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        where = getattr(exc, "filename", None) or partial or root
        if full:
            raise NoSpaceError(errno.ENOSPC, f"{str(root)!r}: the disk filled up while writing {str(where)!r}; "
                                             f"nothing was published, the partial files are removed") from None
        raise ValueError(f"{str(root)!r} is not writable: {exc.strerror} writing {str(where)!r}") from None


def room_left(path: Path) -> int:
    """Bytes an unprivileged write may still use on ``path``'s filesystem (``statvfs``)."""
    st = os.statvfs(next(a for a in (path, *path.absolute().parents) if a.exists()))
    return st.f_bavail * st.f_frsize


def pointer(root: Path) -> Path | None:
    """The step folder ``root/latest`` names (None without a ``latest``); ``ValueError`` unless
    ``latest`` is a regular file holding one name of a step folder's form: a path in it (``..``,
    absolute) or a symlink could lead a save's clean-up, or a load, outside ``root``."""
    path = root / LATEST
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISREG(st.st_mode):
        kind = f"a symlink (to {os.readlink(path)!r})" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise ValueError(f"{path} is {kind}: refused, a checkpoint's {LATEST} is a regular file naming one of "
                         f"its step folders")
    with open(path, "rb") as f:
        name = f.read(64).decode("utf-8", "replace").strip()
    if not _STEP_FOLDER.fullmatch(name):
        raise ValueError(f"{path} names {name!r}: refused, {LATEST} must name a step folder inside "
                         f"{str(root)!r} (step-NNNNNNNN, or step-NNNNNNNN.<hex>), never a path")
    return root / name


def is_folder(path: Path) -> bool:
    """A folder itself, not a symlink to one (which could lead anywhere)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def step_folder(p: Path) -> Path:
    """The step folder ``p`` names: ``p`` itself (a folder the user gave), or the one its
    ``latest`` names, a folder in ``p`` itself; with a ``COMPLETE`` record in it."""
    if not p.is_dir():
        raise ValueError(f"checkpoint {str(p)!r} does not exist or is not a folder")
    step = pointer(p)
    if step is not None:
        if not is_folder(step):
            what = "a symlink" if step.is_symlink() else "missing" if not step.exists() else "not a folder"
            raise ValueError(f"{p / LATEST} names {step.name}, which is {what}: refused, a checkpoint's step "
                             f"folders are folders inside it")
        p = step
    if not os.path.lexists(p / COMPLETE):
        what = "an unfinished save (no COMPLETE record)" if (p / dcp.METADATA).is_file() else "not a tensorpar checkpoint"
        raise ValueError(f"{str(p)!r} is {what}: expected {LATEST} or {COMPLETE} in it")
    return p


def read_record(folder: Path) -> dict:
    """``folder``'s ``COMPLETE`` record: a regular file holding a JSON object with the step."""
    path = folder / COMPLETE
    dcp.regular_file(path, f"{path} is missing")
    try:
        rec = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not JSON ({_first_line(exc)}): a damaged checkpoint (tensorpar writes it last, "
                         f"a JSON object with the step)") from None
    step = rec.get("step") if isinstance(rec, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{path} is not a tensorpar COMPLETE record: expected a JSON object with a non-negative "
                         f"integer 'step', found {str(rec)[:80]}")
    return rec


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:120]
