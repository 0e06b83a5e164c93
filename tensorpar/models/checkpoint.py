"""Load a safetensors checkpoint straight into this rank's shards, never the full model.

1. check the directory (``config.json``, ``model.safetensors`` or a sharded index) and the
   model type (a known family);
2. build the model on the meta device (no parameter memory), check every tensor it needs is in
   the checkpoint with the right shape, and ``parallelize`` it there: the plan, feasibility
   checks and all module swaps happen before a byte of weight is read;
3. read each parameter's :class:`~tensorpar.models.styles.ShardSpec` pieces with
   ``safe_open(...).get_slice(key)[index]``: only this rank's rows or columns are copied.

Each tensor's file is memory-mapped only while that tensor is read, and each block is copied
once, straight into the (padded, transposed) shard. The :class:`LoadReport` compares, with the
bytes of this rank's shard: the growth of private resident memory (the shard itself) and of
peak resident memory (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``), which also
counts the file pages mapped for the tensor being read: at most one tensor's slices, or the
whole tensor for a column slice of a matrix whose rows are shorter than a page.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from tensorpar.sharding.registry import FAMILIES
from tensorpar.sharding.spec import ShardSpec


@dataclass
class LoadReport:
    path: str
    family: str
    tp_size: int
    tp_rank: int
    checkpoint_bytes: int  # every tensor in the checkpoint
    shard_bytes: int  # this rank's parameters and buffers after loading
    bytes_read: int  # bytes of the slices copied out of the checkpoint
    peak_rss_delta_bytes: int | None  # peak resident-memory growth while reading (None: not Linux)
    anon_rss_delta_bytes: int | None  # growth of private (non-file) resident memory
    unexpected_keys: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def load_sharded(path, *, tp_group=None, plan="auto", dtype=None, model_class=None):
    """``(model, LoadReport)``: the checkpoint in ``path`` parallelized over ``tp_group``.

    ``dtype``: of the loaded parameters (default: ``config.dtype``, else float32).
    ``model_class``: a transformers class (default: ``config.architectures[0]``).
    """
    from tensorpar.sharding.apply import parallelize

    path = Path(path)
    files, config = _check_dir(path), _read_config(path)
    dtype = _pick_dtype(dtype, config)
    meta = _tensor_index(files)
    model = _meta_model(config, model_class)
    rename = _check_tensors(model, meta, path)
    parallelize(model, plan, tp_group=tp_group)
    memory = _Memory()
    bytes_read = _materialize(model, meta, rename, dtype)
    peak_delta, anon_delta = memory.deltas()
    unexpected = sorted(set(meta) - _needed_keys(model, rename))
    rep = model.tp_report
    shard = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    total = sum(m[3] for m in meta.values())
    return model, LoadReport(str(path), rep.family, rep.tp_size, rep.tp_rank, total, shard,
                             bytes_read, peak_delta, anon_delta, unexpected)


# ---- the directory -----------------------------------------------------------------------------

def _check_dir(path: Path) -> dict:
    """``{tensor_name: file}``; ValueError for a missing or incomplete directory."""
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {str(path)!r} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"checkpoint directory {str(path)!r} has no config.json; found "
                         f"{sorted(p.name for p in path.iterdir())}")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_index(index)
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise ValueError(f"checkpoint {str(path)!r}: index names files that are missing: {missing}")
        return {k: path / f for k, f in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"checkpoint directory {str(path)!r} has neither model.safetensors nor "
                         f"model.safetensors.index.json; found {sorted(p.name for p in path.iterdir())}")
    return {None: single}


def _read_index(index: Path) -> dict:
    """The ``weight_map`` (tensor name -> file name) of a sharded checkpoint's index."""
    data = _read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(f, str) for f in weight_map.values()):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{index} has no 'weight_map' (a non-empty object of tensor name -> file "
                         f"name); found {found}")
    return weight_map


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def _read_config(path: Path):
    kind = _read_json(path / "config.json").get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"checkpoint {str(path)!r}: model_type {kind!r} is not supported; valid: "
                         f"{', '.join(FAMILIES)}")
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path)


def _pick_dtype(dtype, config):
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        return dtype
    stored = getattr(config, "dtype", None)
    return stored if isinstance(stored, torch.dtype) else torch.float32


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
                "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FLOAT_KINDS = ("F64", "F32", "F16", "BF16")  # what a floating parameter may be stored as


def _file_header(file: Path) -> dict:
    """``{tensor_name: (file, shape, dtype, nbytes)}`` of one file, from its header only."""
    from safetensors import SafetensorError, safe_open
    out = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                shape, kind = tuple(sl.get_shape()), sl.get_dtype()
                n = 1
                for d in shape:
                    n *= d
                out[key] = (file, shape, kind, n * _DTYPE_BYTES.get(kind, 1))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}") from None
    return out


def _tensor_index(files: dict) -> dict:
    """``{tensor_name: (file, shape, dtype, nbytes)}`` from the headers only (no data read);
    with an index, each tensor must be in the file the index names."""
    headers = {file: _file_header(file) for file in sorted(set(files.values()))}
    if None in files:
        return headers[files[None]]
    absent = [f"{k} (index: {f.name})" for k, f in files.items() if k not in headers[f]]
    if absent:
        raise ValueError(f"{len(absent)} tensors are not in the file the index names, e.g. {absent[:3]}")
    return {k: headers[f][k] for k, f in files.items()}


def _meta_model(config, model_class) -> nn.Module:
    """The model with its parameters on the meta device (buffers real), tied as the config says.

    No ``.to(dtype)``: the parameters are allocated in ``dtype`` when read, and a cast here
    would also cast float32 buffers such as rotary ``inv_freq`` (which ``from_pretrained``
    keeps in float32), so a bfloat16 checkpoint would compute another function."""
    import transformers
    from accelerate import init_empty_weights
    if model_class is None:
        arch = (getattr(config, "architectures", None) or [None])[0]
        model_class = getattr(transformers, arch, None) if arch else None
        model_class = model_class or transformers.AutoModel.from_config
    with init_empty_weights():
        model = model_class(config) if isinstance(model_class, type) else model_class(config)
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


# ---- checking the tensors against the model ------------------------------------------------------

def _groups(model) -> list[list[str]]:
    """Names of each parameter (several when tied) and of each persistent buffer."""
    by_id = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), (p, []))[1].append(name)
    buffers = [[n] for n in model.state_dict(keep_vars=True) if n not in
               {x for _, names in by_id.values() for x in names}]
    return [names for _, names in by_id.values()] + buffers


def _renamer(model, keys: set):
    """Checkpoint key of a model name (bare-model checkpoints load into head models and back)."""
    prefix = getattr(model, "base_model_prefix", "") + "."

    def rename(name: str) -> str | None:
        for cand in (name, name[len(prefix):] if name.startswith(prefix) else None, prefix + name):
            if cand in keys:
                return cand
        return None
    return rename


def _check_tensors(model, meta: dict, path: Path):
    rename = _renamer(model, set(meta))
    shapes = dict(model.state_dict(keep_vars=True).items())
    missing, wrong = [], []
    for names in _groups(model):
        key = next((rename(n) for n in names if rename(n)), None)
        if key is None:
            missing.append(names[0])
            continue
        file, found, kind, _ = meta[key]
        if shapes[names[0]].is_floating_point() and kind not in FLOAT_KINDS:
            raise ValueError(f"{file}: tensor {key!r} is stored as {kind}, not as a float; valid: "
                             f"{', '.join(FLOAT_KINDS)} (quantized or integer checkpoints are not "
                             f"supported)")
        if found != tuple(shapes[names[0]].shape):
            wrong.append(f"{key}: checkpoint {found}, model {tuple(shapes[names[0]].shape)}")
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} is missing {len(missing)} tensors that "
                         f"{type(model).__name__} needs, e.g. {missing[:4]}")
    if wrong:
        raise ValueError(f"checkpoint {str(path)!r} does not match its config.json: {len(wrong)} "
                         f"tensors have other shapes, e.g. {wrong[:3]}")
    return rename


def _needed_keys(model, rename) -> set:
    return {rename(n) for names in _groups(model) for n in names if rename(n)}


# ---- reading the shards ---------------------------------------------------------------------------

def _read(meta: dict, key: str, spec: ShardSpec, dtype, counter: list) -> torch.Tensor:
    """This rank's shard of ``key``: the file is mapped only while this one tensor is read, so
    resident file pages never exceed one tensor's slices."""
    from safetensors import safe_open
    with safe_open(str(meta[key][0]), framework="pt") as f:
        sl = f.get_slice(key)

        def get(index):
            block = sl[index] if index else sl[:]  # a view of the mapped file where possible
            counter[0] += block.numel() * block.element_size()
            return block
        return spec.take(get, dtype)


def _materialize(model, meta, rename, dtype) -> int:
    """Replace every meta parameter (and meta persistent buffer) by its shard read from disk."""
    counter, new_of = [0], {}
    for name, p in model.named_parameters():
        spec = getattr(p, "tp_spec", None) or ShardSpec(name)
        key = rename(spec.key) or rename(name)
        new = nn.Parameter(_read(meta, key, spec, dtype, counter), requires_grad=p.requires_grad)
        new.tp_replicas, new.tp_spec = p.tp_replicas, spec
        new_of[id(p)] = new
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None and id(p) in new_of:
                mod._parameters[pname] = new_of[id(p)]
    for name, b in model.named_buffers():
        if b.is_meta:
            key = rename(name)
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = _read(meta, key, ShardSpec(key), None, counter)
    return counter[0]


class _Memory:
    """Resident-memory growth from now: the peak (Linux ``VmHWM`` after a reset through
    ``/proc/self/clear_refs``) and the private part (``RssAnon``); None where unavailable."""

    def __init__(self):
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            self.rss, self.anon = self._status("VmRSS"), self._status("RssAnon")
        except OSError:
            self.rss = self.anon = None

    @staticmethod
    def _status(field_name: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
        raise OSError(field_name)

    def deltas(self) -> tuple[int | None, int | None]:
        if self.rss is None:
            return None, None
        return self._status("VmHWM") - self.rss, self._status("RssAnon") - self.anon
