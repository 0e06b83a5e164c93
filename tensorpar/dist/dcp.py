"""The calls into ``torch.distributed.checkpoint`` (DCP) that :mod:`tensorpar.models.saving` makes.

:class:`Blocks` describes a dense tensor of which this rank holds some blocks, each with its
offsets in the dense tensor, through the protocol DCP asks of a sharded tensor (the one DTensor
implements: ``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``). DCP
then writes each block once (a block several ranks hold is planned on one of them), and on
loading reads each rank's blocks from whichever blocks were written, whatever their layout.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


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
    """Every rank: ``state`` (tensors, :class:`Blocks`, picklable objects) into ``folder``."""
    with _quiet():
        dcp.save(state, checkpoint_id=str(folder), no_dist=_alone())


def read(state: dict, folder: Path) -> None:
    """Every rank: fill ``state`` in place from ``folder`` (objects replaced by the saved ones)."""
    with _quiet():
        dcp.load(state, checkpoint_id=str(folder), no_dist=_alone())


@contextlib.contextmanager
def _quiet():
    """DCP warns that it 'assumes' one process even when told so (``no_dist``): not news here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def metadata(folder: Path):
    """``(saved, files)``: ``{key: (dense shape, dtype), or (None, None) for an object}`` and
    ``{file: bytes its blocks need}``, from the folder's metadata alone."""
    meta = FileSystemReader(str(folder)).read_metadata()
    sizes = {k: (getattr(md, "size", None), getattr(getattr(md, "properties", None), "dtype", None))
             for k, md in meta.state_dict_metadata.items()}
    files: dict = {}
    for info in (meta.storage_data or {}).values():
        files[info.relative_path] = max(files.get(info.relative_path, 0), info.offset + info.length)
    return sizes, files


def dense_state(folder: Path) -> dict:
    """The dense tensors of a DCP folder, in this process (DCP's own conversion, then loaded)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    target = Path(folder) / "dense.pt"
    dcp_to_torch_save(folder, target)
    try:
        return torch.load(target, weights_only=True)
    finally:
        target.unlink()
