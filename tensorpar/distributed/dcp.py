"""The calls into ``torch.distributed.checkpoint`` (DCP) that :mod:`tensorpar.models.saving` makes.

:class:`Blocks` describes a dense tensor of which this rank holds some blocks, each with its
offsets in the dense tensor, through the protocol DCP asks of a sharded tensor (the one DTensor
implements: ``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``). DCP
then writes each block once (a block several ranks hold is planned on one of them), and on
loading reads each rank's blocks from whichever blocks were written, whatever their layout.

A checkpoint folder may come from elsewhere, so nothing in it is trusted to run code or to name
a file outside it. DCP's own reader unpickles ``.metadata`` as is, loads every non-tensor item
with ``torch.load(weights_only=False)`` and joins each file name the metadata gives to the
folder unchecked; every read here instead goes through :func:`checked_metadata` (an unpickler
that admits only DCP's metadata classes, every data file a plain name of a regular file in the
folder) and a load planner whose non-tensor items are read with ``weights_only=True``.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import stat
import warnings
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

METADATA = ".metadata"


class Blocks(torch.Tensor):
    """A dense tensor of shape ``shape`` of which this rank holds ``blocks``: ``[(offsets, view)]``.
    A description for DCP, not a tensor to compute with."""

    @staticmethod
    def __new__(cls, shape, dtype, blocks):
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device="cpu")
        r._blocks = [(torch.Size(o), v) for o, v in blocks if v.numel()]
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(f"{func} on a checkpoint's block description")

    def __create_write_items__(self, fqn, obj):
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=o, sizes=v.shape),
                                                      properties=TensorProperties.create_from_tensor(v),
                                                      size=self.shape))
                for o, v in self._blocks]

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(offsets=o, sizes=v.shape) for o, v in self._blocks]

    def __get_tensor_shard__(self, index):
        for o, v in self._blocks:
            if o == index.offset:
                return v
        raise ValueError(f"{index.fqn}: no block at {tuple(index.offset)} on this rank")


def _alone() -> bool:
    """No process group: one process saves or loads everything (said so, not guessed with a warning)."""
    return not (tdist.is_available() and tdist.is_initialized())


def write(state: dict, folder: Path) -> None:
    """Every rank: ``state`` (tensors, :class:`Blocks`, picklable objects) into ``folder``. A
    failure to write (a full disk) is raised as the error itself, not wrapped in DCP's
    multi-line ``CheckpointException``."""
    try:
        with _quiet():
            dcp.save(state, checkpoint_id=str(folder), no_dist=_alone())
    except CheckpointException as exc:
        raise _failure(exc, Exception) or exc from None


def _failure(exc: CheckpointException, kinds) -> BaseException | None:
    """The first error of ``kinds`` a rank hit under DCP's wrapper, if any (every rank is told
    every rank's failure), to be raised as itself: one line, not DCP's multi-line report."""
    return next((e for e, _ in exc.failures.values() if isinstance(e, kinds)), None)


def read(state: dict, folder: Path, *, alone: bool | None = None) -> None:
    """Every rank (``alone``: this process only, whatever the process group): fill ``state`` in
    place from ``folder`` (objects replaced by the saved ones), through :func:`checked_metadata`
    and :class:`_SafePlanner`."""
    reader = _Reader(folder, checked_metadata(folder))
    try:
        with _quiet():
            dcp.load(state, storage_reader=reader, planner=_SafePlanner(folder),
                     no_dist=_alone() if alone is None else alone)
    except CheckpointException as exc:
        raise _failure(exc, (ValueError, OSError)) or exc from None


@contextlib.contextmanager
def _quiet():
    """DCP warns that it 'assumes' one process even when told so (``no_dist``): not news here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


# ---- reading a folder that may have been crafted --------------------------------------------------

# Every global a DCP ``.metadata`` written by torch 2.13 refers to (found by unpickling real ones,
# saved dense, split and under FSDP, and recording ``find_class``): its dataclasses, torch.Size,
# dtypes, the layout by name (``torch.serialization._get_layout``) and the PosixPath of the
# folder it was saved in. None of these runs code when built from pickled arguments.
_METADATA_CLASSES = {
    **{("torch.distributed.checkpoint.metadata", c.__name__): c for c in (
        Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties, MetadataIndex,
        dcp_metadata.StorageMeta, dcp_metadata._MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): Path,
    # the dtypes by name, listed up front: a lookup of any other name in torch could import a module
    **{("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: any other global is refused, never imported."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES:
            return _METADATA_CLASSES[(module, name)]
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _Refused(f"persistent id {str(pid)[:40]!r}")


class _Refused(pickle.UnpicklingError):
    """A global outside DCP's metadata classes: a crafted file, not a damaged one."""


def checked_metadata(folder: Path) -> Metadata:
    """The DCP metadata of ``folder``, read without running anything it asks for, and checked to
    name only regular files inside ``folder`` (plain names, no symlinks); ``ValueError`` naming
    the file and what was found otherwise. Nothing else in the folder is read before it passes."""
    path = Path(folder) / METADATA
    regular_file(path, f"checkpoint {str(folder)!r} has no {METADATA} file")
    with open(path, "rb") as f:
        try:
            meta = _MetadataUnpickler(f).load()
        except _Refused as exc:
            raise ValueError(f"{path}: refused: its pickle asks for {exc}, which is not one of DCP's metadata "
                             f"classes; a checkpoint's metadata never needs it (a crafted file?)") from None
        except Exception as exc:  # noqa: BLE001 - untrusted bytes: any failure means not metadata
            raise ValueError(f"{path} is not a DCP checkpoint's metadata (damaged or not a checkpoint): "
                             f"{type(exc).__name__}: {_line(exc)}") from None
    _check_types(meta, path)
    for info in meta.storage_data.values():
        _check_storage(Path(folder), info, path)
    return meta


def _line(exc: BaseException) -> str:
    text = str(exc).splitlines()
    return text[0][:160] if text else ""


def _check_types(meta, path: Path) -> None:
    """The unpickled objects have the shapes DCP's reader assumes (a crafted pickle may set any
    attribute of an admitted class)."""
    entries = meta.state_dict_metadata if isinstance(meta, Metadata) else None
    storage = meta.storage_data if isinstance(meta, Metadata) else None
    ok = isinstance(entries, dict) and isinstance(storage, dict) and all(
        isinstance(k, str) and (isinstance(v, BytesStorageMetadata) or _tensor_entry(v)) for k, v in entries.items()
    ) and all(isinstance(k, MetadataIndex) and isinstance(v, _StorageInfo) for k, v in storage.items())
    if not ok:
        raise ValueError(f"{path} is not a DCP checkpoint's metadata: it unpickles to {type(meta).__name__} "
                         f"without the entries and storage records DCP writes")


def _tensor_entry(v) -> bool:
    return (isinstance(v, TensorStorageMetadata) and isinstance(v.size, torch.Size)
            and isinstance(getattr(v.properties, "dtype", None), torch.dtype) and isinstance(v.chunks, list)
            and all(isinstance(c, ChunkStorageMetadata) and isinstance(c.offsets, torch.Size)
                    and isinstance(c.sizes, torch.Size) and len(c.offsets) == len(c.sizes) == len(v.size)
                    for c in v.chunks))


def _check_storage(folder: Path, info: _StorageInfo, path: Path) -> None:
    """One storage record: a plain file name of a regular file in ``folder`` (tensorpar writes
    only those), a non-negative span, and no stream transforms (tensorpar writes none)."""
    name = info.relative_path
    if not isinstance(name, str) or not _plain_name(name):
        raise ValueError(f"{path} names the data file {name!r}: refused, a checkpoint's data files are plain "
                         f"file names inside its folder (no '/', no '..', not absolute)")
    if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0 and info.length >= 0):
        raise ValueError(f"{path}: the record of {name} has offset {info.offset!r} and length {info.length!r}; "
                         f"both must be non-negative integers")
    if info.transform_descriptors:
        raise ValueError(f"{path}: {name} is stored through transforms {list(info.transform_descriptors)[:3]}; "
                         f"tensorpar writes and reads plain files only")
    regular_file(folder / name, f"checkpoint {str(folder)!r} is missing its file {name}")


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def regular_file(path: Path, missing: str) -> os.stat_result:
    """``lstat`` of ``path``: a regular file itself, not a symlink (which could lead anywhere)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ValueError(missing) from None
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{path} is a symlink (to {os.readlink(path)!r}): refused, tensorpar reads only "
                         f"regular files inside a checkpoint folder")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    return st


def metadata(folder: Path):
    """``(saved, files)``: ``{key: (dense shape, dtype), or (None, None) for an object}`` and
    ``{file: bytes its blocks need}``, from the folder's (checked) metadata alone."""
    meta = checked_metadata(folder)
    sizes = {k: (getattr(md, "size", None), getattr(getattr(md, "properties", None), "dtype", None))
             for k, md in meta.state_dict_metadata.items()}
    files: dict = {}
    for info in meta.storage_data.values():
        files[info.relative_path] = max(files.get(info.relative_path, 0), info.offset + info.length)
    return sizes, files


def check_objects(folder: Path) -> None:
    """Every non-tensor item of ``folder`` (the step, the optimizer's hyperparameters) loads with
    ``torch.load(weights_only=True)``: ``ValueError`` naming the item and file otherwise. Read
    before anything is loaded, so that a crafted item is refused before any tensor changes."""
    meta = checked_metadata(folder)
    for index, info in meta.storage_data.items():
        if isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            with open(Path(folder) / info.relative_path, "rb") as f:
                f.seek(info.offset)
                _load_object(io.BytesIO(f.read(info.length)), index.fqn, Path(folder) / info.relative_path)


def _load_object(data: io.BytesIO, key: str, file):
    try:
        return torch.load(data, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: refused whatever the failure
        raise ValueError(f"{file}: item {key!r} is refused: it does not load as plain data with "
                         f"torch.load(weights_only=True) ({type(exc).__name__}: {_line(exc)})") from None


class _Reader(FileSystemReader):
    """DCP's file reader, given metadata :func:`checked_metadata` has already read and checked."""

    def __init__(self, folder: Path, meta: Metadata):
        super().__init__(str(folder))
        self._meta = meta

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._meta


class _SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor items read with ``weights_only=True`` (DCP's
    own reads them with ``weights_only=False``: any pickle, any code)."""

    def __init__(self, folder: Path):
        super().__init__()
        self._folder = folder

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        obj = _load_object(value, key, f"checkpoint {str(self._folder)!r}")
        if self.flatten_state_dict:  # as DCP's own load_bytes places it (set_element is what it calls)
            set_element(self.original_state_dict, self.mappings[key], obj)
        else:
            self.state_dict[key] = obj


def dense_state(folder: Path) -> dict:
    """The dense tensors of a DCP folder, in this process alone (rank 0 of an export, the other
    ranks waiting), through the checked reader; nothing is written next to it."""
    entries = checked_metadata(folder).state_dict_metadata
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in entries.items()
             if isinstance(md, TensorStorageMetadata)}
    read(state, folder, alone=True)
    return state
