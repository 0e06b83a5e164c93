"""Checkpoints of a parallelized model and its optimizer, on PyTorch's distributed checkpoint (DCP).

What is written does not depend on the layout. Every parameter, and every optimizer state shaped
like it, is stored as the *dense* tensor it is a piece of, under the parameter's name (for a
Hugging Face model: its checkpoint key): each rank contributes the blocks it holds, with their
offsets in the dense tensor (its :class:`~tensorpar.sharding.spec.ShardSpec` pieces; under FSDP
the dp rank's rows of them; zero padding never). Nothing is gathered: every rank writes its own
blocks (a block several ranks hold, as a replicated tensor, is written once, by DCP's plan).
Loading asks each rank's blocks in its own layout, and DCP reads them from whatever blocks were
written: a checkpoint saved at dp 2 x tp 2 loads at tp 4, tp 1 or dp 4. DCP's own tools read it
(its ``format_utils.dcp_to_torch_save`` gives the dense state dict). The DCP calls themselves are
in :mod:`tensorpar.distributed.dcp`.

Atomic: a save writes into a hidden folder, and only when every rank has finished does rank 0
write its ``COMPLETE`` record, move it to ``step-NNNNNNNN`` and replace the ``latest`` pointer
(``os.replace``). A save interrupted anywhere leaves ``latest`` on the previous checkpoint; the
unfinished folder has no ``COMPLETE`` and is never read.

Also stored: the step, the optimizer's kind and hyperparameters, and each rank's torch RNG state
and, for a model with dropout, its per-rank tensor-parallel generator state (both restored
when the world size is the same).

A checkpoint folder is not trusted: nothing in it may run code or make tensorpar read, write or
delete outside it (its ``latest`` and step folders: :mod:`tensorpar.models.checkpoint_folder`;
its metadata, data files and non-tensor items: :func:`tensorpar.distributed.dcp.checked_metadata`), all
checked before anything is loaded.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import shutil
from pathlib import Path

import torch

from tensorpar import distributed as dist
from tensorpar.distributed import dcp
from tensorpar.models import checkpoint_folder as cf
from tensorpar.models.checkpoint_folder import COMPLETE, LATEST, NoSpaceError, check_writable  # noqa: F401 (the API)
from tensorpar.models.training import fsdp_first_row
from tensorpar.nn.random import TP_RNG
from tensorpar.sharding.commit import restore_tags
from tensorpar.sharding.spec import ShardSpec


def _dense_sizes(model, params) -> dict:
    """``{name: dense size along the split dim}`` of every split parameter: the largest piece end
    over the tp ranks (their pieces cover the dim), one all-reduce for all."""
    split = [(n, p) for n, p in params if getattr(p, "tp_spec", None) is not None and p.tp_spec.is_shard]
    if not split:
        return {}
    ends = torch.tensor([max(b for _, b in p.tp_spec.pieces) for _, p in split], dtype=torch.float64)
    report = model.tp_report
    if report.tp_size > 1:  # (split parameters exist only on a parallelized model)
        dist.all_reduce(ends, group=report.tp_group, op="max")
    return {n: int(e) for (n, _), e in zip(split, ends.tolist())}


def _describe(t: torch.Tensor, p, dense_size: int | None, dp_rows) -> "dcp.Blocks":
    """``t`` (the parameter or a state shaped like it, as this rank holds it) as dense blocks."""
    spec = getattr(p, "tp_spec", None) or ShardSpec("")  # a model never parallelized: all whole
    local = t.to_local() if hasattr(t, "to_local") else t
    shape = list(t.shape)  # the tp shard's (FSDP: the whole of it)
    if spec.transpose and len(shape) == 2:
        if dp_rows is not None and hasattr(t, "to_local"):
            raise ValueError(f"{spec.key}: a transposed (Conv1D) shard under FSDP is not supported by save/load yet")
        local, shape = local.t(), shape[::-1]
    sharded = dp_rows is not None and hasattr(t, "to_local")  # FSDP keeps an unsharded root as plain tensors
    r0 = dp_rows(shape[0]) if sharded else 0  # this dp rank's first row of the tp shard
    rows = (r0, r0 + local.shape[0]) if local.dim() else None
    if not spec.is_shard:
        return dcp.Blocks(shape, local.dtype, [((r0,) + (0,) * (len(shape) - 1) if shape else (), local)])
    dim, dense = spec.dim, list(shape)
    dense[dim] = dense_size
    blocks, at = [], 0
    for a, b in spec.pieces:
        lo, hi, offset = at, at + (b - a), a  # the piece's span in the tp shard along dim
        at = hi
        if dim == 0:
            lo2, hi2 = max(lo, rows[0]), min(hi, rows[1])
            if lo2 < hi2:
                blocks.append(((a + lo2 - lo,) + (0,) * (len(shape) - 1), local.narrow(0, lo2 - rows[0], hi2 - lo2)))
            continue
        offsets = [0] * len(shape)
        offsets[0], offsets[dim] = rows[0], offset
        blocks.append((tuple(offsets), local.narrow(dim, lo, hi - lo)))
    return dcp.Blocks(dense, local.dtype, blocks)


def _is_split(model) -> bool:
    report = getattr(model, "tp_report", None)
    return report is not None and (report.tp_size > 1 or getattr(report, "data_parallel", None) is not None
                                   or getattr(report, "pp_size", 1) > 1)


def _reshard(model) -> None:
    if callable(getattr(model, "reshard", None)):  # FSDP: the root's parameters back to their dp shards
        model.reshard()


def _fsdp_rows(model):
    report = getattr(model, "tp_report", None)
    if getattr(report, "data_parallel", None) != "fsdp":
        return None
    return fsdp_first_row(report)


def _state(model, optimizer, step: int | None) -> dict:
    """What DCP writes or fills: every parameter and optimizer state as dense blocks, the rest as is."""
    _reshard(model)
    restore_tags(model)
    params = list(model.named_parameters())
    sizes, rows = _dense_sizes(model, params), _fsdp_rows(model)
    out = {f"model.{n}": _describe(p.data if not hasattr(p, "to_local") else p, p, sizes.get(n), rows)
           for n, p in params}
    if optimizer is not None:
        names = {id(p): n for n, p in params}
        split = _is_split(model)
        for p, st in optimizer.state.items():
            if id(p) not in names:
                raise ValueError("the optimizer holds state for a tensor that is not one of the model's parameters")
            for k, v in st.items():
                key = f"optim.{names[id(p)]}.{k}"
                shaped = isinstance(v, torch.Tensor) and v.dim() and tuple(v.shape) == tuple(p.shape)
                if split and isinstance(v, torch.Tensor) and v.dim() and not shaped:
                    raise ValueError(f"{key}: optimizer state of shape {tuple(v.shape)} beside a parameter of "
                                     f"{tuple(p.shape)} (a factored optimizer's) cannot be placed in the dense "
                                     f"tensor on a split model; save supports states shaped like their parameter")
                out[key] = _describe(v, p, sizes.get(names[id(p)]), rows) if shaped else v
        out["optim.param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    out["step"] = step
    out[f"rng.{dist.get_rank()}"] = torch.get_rng_state()
    fork = model.__dict__.get("_tp_rng_fork")
    if fork is not None:  # the per-rank state dropout draws from where activations are sharded
        out[_tp_rng_key()] = fork.tracker.get_state()
    return out


def _tp_rng_key() -> str:
    return f"rng.{dist.get_rank()}.tensor_parallel"


def save(model, optimizer, path, *, step: int, extra: dict | None = None) -> Path:
    """Every rank calls it: ``path/step-NNNNNNNN`` written and made ``path/latest`` (see the module).
    ``extra``: a JSON-serialisable dict kept in the checkpoint's ``COMPLETE`` record (what a
    training job needs to resume the same run: its data and batch settings), read back by
    :func:`record`. Returns the checkpoint's folder. Checked before anything is written (a
    ``ValueError`` naming the folder): ``path`` is a folder this process can write into or
    create, a ``latest`` already there is tensorpar's own, and the checkpoint's bytes fit on its
    filesystem; a disk that fills up during the write raises :class:`NoSpaceError`, the partial
    files removed."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if extra is not None:
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"extra must be a JSON-serialisable dict: {exc}") from None
    root = Path(path)
    check_writable(root)
    cf.pointer(root)  # a latest that names anything else is refused before a byte is written
    state = _state(model, optimizer, step)
    cf.check_room(root, _nbytes(state))
    nonce, name = _names(root, step)
    tmp, final = root / f".step-{step:08d}.{nonce}.partial", root / name
    with cf.writing(root, tmp, _largest(state)):
        dcp.write(state, tmp)
    dist.barrier()  # every rank's blocks are on disk
    if dist.get_rank() == 0:
        kind = {} if optimizer is None else {"optimizer": type(optimizer).__name__}
        with cf.writing(root, None):
            _commit(root, tmp, final, {"step": step, **_layout(model), **kind,
                                       **({"extra": extra} if extra is not None else {})})
    dist.barrier()
    return final


# DCP stores each tensor item with a header, and the metadata beside; measured on the tiny Llama's AdamW
# checkpoint (87 items, 1.3 MB): 1.13 x the tensors' bytes. 1.25 x and 1 MiB leave room for more, smaller items.
_OVERHEAD, _SLACK = 1.25, 2**20


def disk_bytes(tensor_bytes: int) -> int:
    """What a checkpoint of dense tensors of ``tensor_bytes`` in all takes on disk, at most (for a
    job to check its folders before training: an AdamW checkpoint holds 3 x the parameters'
    bytes; an export needs twice ``disk_bytes`` of the parameters, its blocks and file at once)."""
    return int(tensor_bytes * _OVERHEAD) + _SLACK


def _nbytes(state: dict) -> int:
    """What a save of ``state`` puts on disk, at most: every dense tensor once (whichever ranks
    hold its blocks), with DCP's per-item overhead."""
    return disk_bytes(sum(math.prod(v.shape) * v.dtype.itemsize for v in state.values() if isinstance(v, torch.Tensor)))


def _largest(state: dict) -> int:
    return max((math.prod(v.shape) * v.dtype.itemsize for v in state.values() if isinstance(v, torch.Tensor)),
               default=0)


def _nonce() -> str:
    """A name part rank 0 draws and every rank shares (folders of one export)."""
    return dist.broadcast_object(secrets.token_hex(4) if dist.get_rank() == 0 else None)


def _names(root: Path, step: int) -> tuple[str, str]:
    """The save's nonce and its checkpoint folder's name, which rank 0 picks before anything is
    written and every rank shares: ``step-NNNNNNNN``, or ``step-NNNNNNNN.NONCE`` when the same
    step is saved again (a folder of its own; ``latest`` then moves to it). Were each rank to look
    for itself, one that looked after rank 0 had published the save would see its folder and
    return another name (it did, on a loaded machine)."""
    if dist.get_rank() != 0:
        return dist.broadcast_object(None)
    nonce, name = secrets.token_hex(4), f"step-{step:08d}"
    return dist.broadcast_object((nonce, f"{name}.{nonce}" if os.path.lexists(root / name) else name))


def _layout(model) -> dict:
    report = getattr(model, "tp_report", None)
    return {"world_size": dist.get_world_size(), "tp_size": getattr(report, "tp_size", 1),
            "dp_size": getattr(report, "dp_size", 1), "data_parallel": getattr(report, "data_parallel", None),
            "pp_size": getattr(report, "pp_size", 1), "virtual_stages": getattr(report, "virtual_stages", 1)}


def _commit(root: Path, tmp: Path, final: Path, record: dict) -> None:
    """Publish ``tmp`` as ``final``: its COMPLETE record, the rename, then ``latest`` replaced;
    each step on disk (fsync) before the next, so a crash anywhere leaves ``latest`` on a whole
    checkpoint."""
    _durable_write(tmp / COMPLETE, json.dumps(record))
    _fsync_dir(tmp)
    previous = cf.pointer(root)
    tmp.rename(final)
    _fsync_dir(root)
    pointer = root / f".{LATEST}.{secrets.token_hex(4)}"
    _durable_write(pointer, final.name)
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    if previous is not None and previous != final and previous.name.split(".")[0] == final.name.split(".")[0]:
        # the same step's older save, now unreferenced: a folder in root (_pointer admits a plain
        # name only), or a symlink, which rmtree refuses rather than follow
        shutil.rmtree(previous, ignore_errors=True)


def _durable_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(path) -> Path:
    """The complete checkpoint folder ``path`` names (a root with ``latest``, or a step folder),
    checked whole before anything is loaded (see :func:`_open`); ``ValueError`` naming what is
    missing, damaged or refused otherwise."""
    return _open(path)[0]


def record(path) -> dict:
    """The ``COMPLETE`` record of the checkpoint ``path`` names: ``step``, the layout it was saved
    at, the optimizer's kind, and ``extra`` when :func:`save` was given one."""
    return _open(path)[1]


def _open(path) -> tuple[Path, dict, dict]:
    """``(folder, record, saved)`` of the checkpoint ``path`` names, ``saved`` being ``{key: (dense
    shape, dtype)}``. Checked in this order, nothing read before the checks that guard it: the
    folder and its ``latest``; its ``COMPLETE`` record (JSON); the metadata (unpickled without
    running anything, naming only regular files inside the folder); each data file long enough
    for its blocks; every non-tensor item plain data."""
    folder = cf.step_folder(Path(path))
    rec = cf.read_record(folder)
    saved, files = dcp.metadata(folder)
    for name, size in sorted(files.items()):
        f = folder / name
        if f.stat().st_size < size:
            raise ValueError(f"checkpoint file {str(f)!r} is truncated: {f.stat().st_size} bytes, needs {size}")
    dcp.check_objects(folder)
    return folder, rec, saved


def load(model, optimizer, path) -> int:
    """Every rank calls it: the model's parameters and the optimizer's state from the checkpoint at
    ``path`` (any layout), into this rank's blocks; returns the saved step. Checked first, before
    anything changes: the folder is a complete, untampered checkpoint (:func:`resolve`), it holds
    every parameter at this model's dense shape, and its optimizer is of this optimizer's kind
    (``ValueError`` naming the key or the file)."""
    folder, rec, saved = _open(path)
    _reshard(model)
    _check_keys(folder, saved, _state(model, None, 0))
    if optimizer is not None:
        groups = {k.split(".")[2] for k in saved if k.startswith("optim.param_groups.")}  # DCP flattens the list
        if not groups:
            raise ValueError(f"checkpoint {str(folder)!r} was saved without an optimizer; load it with optimizer=None")
        _check_optimizer(folder, rec, saved, model, optimizer)
        if len(groups) != len(optimizer.param_groups):
            raise ValueError(f"checkpoint {str(folder)!r} has {len(groups)} optimizer parameter groups, "
                             f"this optimizer {len(optimizer.param_groups)}")
        _init_optimizer_state(model, optimizer, saved)
    state = _state(model, optimizer, 0)
    _check_keys(folder, saved, state)
    unpipelined = {"pp_size": 1, "virtual_stages": 1}  # what a checkpoint from before pipeline stages had
    same_layout = all(rec.get(k, unpipelined.get(k)) == v for k, v in _layout(model).items())
    if not same_layout:  # another rank numbering: a rank's generator is not this rank's to take
        state.pop(f"rng.{dist.get_rank()}")
    if not same_layout or _tp_rng_key() not in saved:
        state.pop(_tp_rng_key(), None)
    with torch.no_grad():  # into the parameters' own storage
        dcp.read(state, folder)
    if optimizer is not None:
        _restore_groups(optimizer, state["optim.param_groups"])
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in optimizer.state.items():
            for k, v in st.items():
                if not (isinstance(v, torch.Tensor) and v.dim()):
                    st[k] = state[f"optim.{names[id(p)]}.{k}"]
    if same_layout:
        torch.set_rng_state(state[f"rng.{dist.get_rank()}"])
    if _tp_rng_key() in state:
        model.__dict__["_tp_rng_fork"].tracker.set_state(TP_RNG, state[_tp_rng_key()])
    return int(state["step"])


def _check_keys(folder, saved: dict, state: dict) -> None:
    for key, value in state.items():
        if key.startswith("rng.") or key in ("step", "optim.param_groups"):
            continue
        if key not in saved:
            what = "the optimizer state " if key.startswith("optim.") else ""
            raise ValueError(f"checkpoint {str(folder)!r} has no {what}{key!r}: it is of another model")
        want = saved[key][0]
        if isinstance(value, torch.Tensor) and want is not None and tuple(want) != tuple(value.shape):
            raise ValueError(f"checkpoint {str(folder)!r}: {key!r} is {tuple(want)} there and "
                             f"{tuple(value.shape)} in this model")


def _check_optimizer(folder, rec: dict, saved: dict, model, optimizer) -> None:
    """The checkpoint's optimizer is of this optimizer's kind: its class as recorded (Adam's
    state in AdamW would take AdamW's hyperparameters), or, in a record from before the class was
    kept, state names in common. ``ValueError`` naming both kinds and their state names."""
    theirs, ours = _saved_state_names(model, saved), _state_names(optimizer)
    kind = rec.get("optimizer")
    differ = kind != type(optimizer).__name__ if kind is not None else bool(ours and theirs and not ours & theirs)
    if differ:
        raise ValueError(f"checkpoint {str(folder)!r} holds the state of {kind or 'another optimizer'} "
                         f"({', '.join(sorted(theirs)) or 'none'}), this optimizer is {type(optimizer).__name__} "
                         f"({', '.join(sorted(ours)) if ours is not None else 'state names unknown'}): the optimizer "
                         f"kinds differ; load into the same kind, or with optimizer=None for the weights alone")


def _saved_state_names(model, saved: dict) -> set:
    names = set()
    for n, _ in model.named_parameters():
        prefix = f"optim.{n}."
        names |= {k[len(prefix):] for k in saved if k.startswith(prefix)}
    return names


def _state_names(optimizer) -> set | None:
    """The names of the state ``optimizer`` keeps per parameter: its own after a step, else those
    a copy of it keeps after one step on a one-element tensor (None if that copy cannot run)."""
    held = {k for st in optimizer.state.values() for k in st}
    if held:
        return held
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    p.grad = torch.zeros_like(p)
    try:
        probe = type(optimizer)([p], **{k: v for k, v in optimizer.defaults.items() if k not in _IMPLEMENTATION})
        probe.step()
    except Exception:  # noqa: BLE001 - an optimizer of unknown construction: names unknown, not an error
        return None
    return set(probe.state[p])


# how an optimizer runs, not what it learned: this process's choice, never the checkpoint's
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable", "maximize_impl")


def _restore_groups(optimizer, groups: list) -> None:
    for group, saved in zip(optimizer.param_groups, groups):  # as many: load checked it first
        group.update({k: v for k, v in saved.items() if k not in _IMPLEMENTATION})


def _init_optimizer_state(model, optimizer, saved) -> None:
    """A fresh optimizer has no state yet: zeros of the saved kinds, to be filled."""
    for n, p in model.named_parameters():
        if optimizer.state.get(p):
            continue
        prefix = f"optim.{n}."
        kinds = {k[len(prefix):]: md for k, md in saved.items() if k.startswith(prefix)}
        dense = saved.get(f"model.{n}", (None, None))[0]  # the parameter's dense shape, as saved
        state = {}
        for kind, (size, dtype) in kinds.items():
            if size is not None and p.dim() and dense is not None and tuple(size) == tuple(dense):
                state[kind] = torch.zeros_like(p)  # shaped like the parameter: its shard (a DTensor under FSDP)
            elif size is not None:
                state[kind] = torch.zeros(tuple(size), dtype=dtype)  # a step count, or a scalar's state
        if state:
            optimizer.state[p] = state


def export(model, path) -> Path:
    """Every rank calls it: ``path`` becomes a Hugging Face directory (``config.json`` and
    ``model.safetensors``) of the dense model this split one computes, which ``from_pretrained``
    and :func:`~tensorpar.models.checkpoint.load_sharded` load at any tp. The blocks go through a
    DCP folder beside ``path`` as in :func:`save` (each rank writes its own); rank 0 alone
    assembles the dense tensors, one file. Checked first, as :func:`save` checks: ``path`` a
    folder that can be written, with room for the blocks and the file at once, and none of the
    files it writes a symlink (which would lead the write elsewhere)."""
    from safetensors.torch import save_file

    root = Path(path)
    check_writable(root)
    for name in _EXPORTED:
        if (root / name).is_symlink():
            raise ValueError(f"{root / name} is a symlink (to {os.readlink(root / name)!r}): refused, export "
                             f"writes regular files inside {str(root)!r}")
    state = {k: v for k, v in _state(model, None, None).items() if k.startswith("model.")}
    cf.check_room(root, 2 * _nbytes(state))  # the blocks folder and the assembled file exist at once
    tmp = root.parent / f".{root.name}.{_nonce()}.blocks"
    with cf.writing(root, tmp, _largest(state)):
        dcp.write(state, tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        try:
            with cf.writing(root, None, _largest(state)):
                tensors = {k.removeprefix("model."): v.contiguous() for k, v in dcp.dense_state(tmp).items()}
                root.mkdir(parents=True, exist_ok=True)
                save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
                model.config.save_pretrained(root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    return root


_EXPORTED = ("model.safetensors", "config.json", "generation_config.json")  # what export writes in its folder
