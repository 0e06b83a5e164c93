"""Load a safetensors checkpoint straight into this rank's shards, never the full model.

1. check the directory (``config.json``, ``model.safetensors`` or a sharded index) and the
   model type (any transformers knows);
2. build the model on the meta device (no parameter memory) and map every tensor it needs to
   the checkpoint tensors it is made of, through transformers' own conversion mapping
   (:mod:`tensorpar.models.conversion`: renamed keys; Mixtral's per-expert ``w1``/``w3`` stacked
   and concatenated into ``experts.gate_up_proj``); check each is there, stored as a float, with
   the shape the config gives; then ``parallelize`` the meta model (proved on a small replica of
   the config): the plan, feasibility checks and all module swaps happen before a byte of
   weight is read;
3. read each parameter's :class:`~tensorpar.sharding.spec.ShardSpec` pieces: a plain tensor
   with ``safe_open(...).get_slice(key)[index]``, a converted one through its op chain, so only
   this rank's rows or columns of each checkpoint tensor are copied. A converter whose ops
   cannot be sliced through is read whole, converted by its own ops, then cut; the
   :class:`LoadReport` names those tensors and the extra bytes.

The files a tensor is read from are memory-mapped only while that tensor is read, and each
block is copied into the (padded, transposed) shard: once for a plain tensor, twice for a
converted one (stacked or concatenated first). The :class:`LoadReport` compares, with the bytes
of this rank's shard: the growth of private resident memory (the shard itself) and of peak
resident memory (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``), which also counts
the file pages mapped for the tensor being read: at most its slices of the checkpoint tensors
it is made of (whole tensors for a column slice of a matrix whose rows are shorter than a page,
and for a tensor read whole).
"""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from tensorpar.architecture import configs
from tensorpar.models.conversion import map_checkpoint
from tensorpar.sharding.commit import rng_to
from tensorpar.sharding.pipeline import parallelize
from tensorpar.sharding.model_classes import eager_experts, meta_model
from tensorpar.sharding.spec import ShardSpec


@dataclass
class LoadReport:
    path: str
    family: str
    tp_size: int
    tp_rank: int
    checkpoint_bytes: int  # every tensor in the checkpoint
    shard_bytes: int  # this rank's parameters and buffers after loading
    bytes_read: int  # bytes copied out of the checkpoint (slices, and tensors read whole)
    peak_rss_delta_bytes: int | None  # peak resident-memory growth while reading (None: not Linux)
    anon_rss_delta_bytes: int | None  # growth of private (non-file) resident memory
    unexpected_keys: list = field(default_factory=list)
    converted: dict = field(default_factory=dict)  # model tensor -> the converter ops that built it
    read_whole: list = field(default_factory=list)  # converted tensors whose sources were read whole
    extra_bytes_read: int = 0  # bytes read beyond this rank's slices (the read_whole tensors)

    def to_dict(self) -> dict:
        return asdict(self)


def load_sharded(path, *, tp_group=None, plan="auto", dtype=None, model_class=None, device=None):
    """``(model, LoadReport)``: the checkpoint in ``path`` parallelized over ``tp_group``.

    ``plan``: as for :func:`~tensorpar.sharding.pipeline.parallelize`. ``dtype``: of the loaded
    parameters (default: ``config.dtype``, else float32). ``model_class``: a transformers class
    (default: ``config.architectures[0]``, else the causal-LM, masked-LM or bare model class).
    ``device``: where the shards go (default: the host); each is moved there as soon as it is
    read, so the host holds one tensor's slices at a time. The report's memory figures are the
    host's.
    """
    path = Path(path)
    files = _check_dir(path)
    meta = _tensor_index(files)
    _check_sizes(_read_json(path / "config.json"), meta, path)
    config = _read_config(path)
    dtype = _pick_dtype(dtype, config)
    with _default_dtype(dtype):  # as from_pretrained builds it: tensors a module does not fix take dtype
        model = meta_model(config, model_class)
    if dtype == torch.float64:
        eager_experts(model)
    sources, unexpected = map_checkpoint(model, {k: m[1] for k, m in meta.items()})
    source_of = _check_tensors(model, sources, meta, path)
    dtypes = _dtypes(model, dtype)
    parallelize(model, plan, tp_group=tp_group)
    memory = _Memory()
    device = _placed(device)
    reads = _materialize(model, source_of, meta, dtypes, device)
    rng_to(model, device)
    peak_delta, anon_delta = memory.deltas()
    rep = model.tp_report
    shard = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    total = sum(m[3] for m in meta.values())
    converted = {s.target: s.ops for s in {id(s): s for s in source_of.values()}.values() if s.ops}
    return model, LoadReport(str(path), rep.family, rep.tp_size, rep.tp_rank, total, shard,
                             reads.bytes, peak_delta, anon_delta, unexpected, converted,
                             reads.whole, reads.extra)


# ---- the directory -----------------------------------------------------------------------------

def _check_dir(path: Path) -> dict:
    """``{tensor_name: file}``; ValueError for a missing or incomplete directory."""
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {str(path)!r} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"checkpoint directory {str(path)!r} has no config.json; found "
                         f"{sorted(p.name for p in path.iterdir())}")
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        weight_map = _read_index(index)
        outside = sorted({f for f in weight_map.values() if not _inside(path, f)})
        if outside:
            raise ValueError(f"{index} names files outside the checkpoint folder: {outside[:3]}; tensorpar reads "
                             f"only files inside {str(path)!r} (and, in the hub cache, its own blobs/)")
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise ValueError(f"checkpoint {str(path)!r}: index names files that are missing: {missing}")
        if single.is_file() and "model.safetensors" not in weight_map.values():
            raise ValueError(f"checkpoint {str(path)!r} has both model.safetensors and {index.name}, which does "
                             f"not name it: one of them is stale; remove the one that does not belong")
        return {k: path / f for k, f in weight_map.items()}
    if not single.is_file():
        raise ValueError(f"checkpoint directory {str(path)!r} has neither model.safetensors nor "
                         f"model.safetensors.index.json; found {sorted(p.name for p in path.iterdir())}")
    return {None: single}


def _inside(path: Path, name: str) -> bool:
    """``path/name`` is a file of the checkpoint folder: ``name`` a relative path without ``..``,
    and its target inside the folder, or, for a snapshot of the Hugging Face hub cache
    (``models--org--name/snapshots/<rev>/``, whose files are symlinks to ``../../blobs/<sha>``),
    inside that same cache repository's ``blobs/``."""
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or ".." in parts:
        return False
    root, target = path.resolve(), (path / name).resolve()
    allowed = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        allowed.append(root.parent.parent / "blobs")
    return any(a in target.parents for a in allowed)


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
    from transformers import AutoConfig, __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    data = _read_json(path / "config.json")
    kind = data.get("model_type") if isinstance(data, dict) else None
    if kind not in CONFIG_MAPPING_NAMES:
        raise ValueError(f"checkpoint {str(path)!r}: model_type {kind!r} is not known to transformers "
                         f"{__version__} (config.json's model_type must name one of its architectures, "
                         f"e.g. llama, mixtral, gpt2, bert)")
    try:
        return AutoConfig.from_pretrained(path)
    except (TypeError, ValueError, ZeroDivisionError, KeyError, AttributeError) as exc:
        raise ValueError(f"{path / 'config.json'}: transformers cannot build this {kind} config: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None


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


def check_checkpoint(path, *, model_class=None) -> dict:
    """Everything ``load_sharded`` checks before it reads a weight, for a parent process to run
    before any rank starts: the directory, the index (every file it names inside the folder and
    present, no stale index beside a single file), every safetensors header, config.json, and every
    tensor the model needs present with its shape and a float storage (through transformers' own
    checkpoint conversions, on a meta-device model). Returns ``{tensor_name: (file, shape, dtype,
    nbytes)}``; raises ``ValueError`` naming the file and tensor. Reads headers only."""
    path = Path(path)
    files = _check_dir(path)
    meta = _tensor_index(files)
    _check_sizes(_read_json(path / "config.json"), meta, path)
    model = meta_model(_read_config(path), model_class)
    sources, _ = map_checkpoint(model, {k: m[1] for k, m in meta.items()})
    _check_tensors(model, sources, meta, path)
    return meta


_LAYER_KEY = re.compile(r"\.(?:layers|layer|h|blocks|block)\.(\d+)\.")


def _check_sizes(config: dict, meta: dict, path: Path) -> None:
    """config.json's core sizes (``configs.CORE_SIZES``, at the top and in every nested config) are
    positive integers (per layer: a list of them), and it asks for no more layers than the
    checkpoint holds: checked before a model is built (a billion layers would be built, on the
    meta device, until memory runs out)."""
    if not isinstance(config, dict):
        raise ValueError(f"{path / 'config.json'} is not a JSON object (got {type(config).__name__})")
    configs.check_sizes(config, str(path / "config.json"))
    subs = [cfg for _, cfg in configs.nested(config)]
    held = {int(m.group(1)) for key in meta for m in [_LAYER_KEY.search(f".{key}")] if m}
    if not held:
        return
    for cfg in subs:
        for name in configs.NAMES["layers"]:
            v = cfg.get(name)
            if isinstance(v, int) and v > max(held) + 1:
                raise ValueError(f"{path / 'config.json'}: {name}={v} but the checkpoint's tensors hold layers "
                                 f"0..{max(held)} only ({max(held) + 1}); config.json does not describe these weights")


def _file_header(file: Path) -> dict:
    """``{tensor_name: (file, shape, dtype, nbytes)}`` of one file, from its header only."""
    from safetensors import SafetensorError, safe_open
    out = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                shape, kind = tuple(sl.get_shape()), sl.get_dtype()
                out[key] = (file, shape, kind, _numel(shape) * _DTYPE_BYTES.get(kind, 1))
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
        index = next(iter(files.values())).parent / "model.safetensors.index.json"
        raise ValueError(f"{index}: {len(absent)} tensors are not in the file the index names, e.g. {absent[:3]}")
    return {k: headers[f][k] for k, f in files.items()}


# ---- checking the tensors against the model ------------------------------------------------------

def _groups(model) -> list[list[str]]:
    """Names of each parameter (several when tied) and of each persistent buffer."""
    by_id = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), (p, []))[1].append(name)
    params = {x for _, names in by_id.values() for x in names}
    buffers = [[n] for n in model.state_dict(keep_vars=True) if n not in params]
    return [names for _, names in by_id.values()] + buffers


def _check_tensors(model, sources: dict, meta: dict, path: Path) -> dict:
    """``{model tensor name: Source}`` (every name of a tied group: the group's one source);
    ValueError for a missing tensor, a non-float storage of a float tensor, or another shape."""
    shapes = dict(model.state_dict(keep_vars=True).items())
    source_of, missing, wrong = {}, [], []
    for names in _groups(model):
        src = next((sources[n] for n in names if n in sources), None)
        if src is None:
            missing.append(names[0])
            continue
        if shapes[names[0]].is_floating_point():
            _check_float(src, meta)
        if src.shape != tuple(shapes[names[0]].shape):
            what = src.keys[0] if not src.ops else f"{src.target} (from {len(src.keys)} tensors by {src.ops})"
            wrong.append(f"{what}: checkpoint {src.shape}, model {tuple(shapes[names[0]].shape)}")
        source_of.update({n: src for n in names})
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} is missing {len(missing)} tensors that "
                         f"{type(model).__name__} needs, e.g. {missing[:4]}")
    if wrong:
        raise ValueError(f"checkpoint {str(path)!r} does not match its config.json: {len(wrong)} "
                         f"tensors have other shapes, e.g. {wrong[:3]}")
    return source_of


def _check_float(src, meta: dict) -> None:
    for key in src.keys:
        file, _, kind, _ = meta[key]
        if kind not in FLOAT_KINDS:
            raise ValueError(f"{file}: tensor {key!r} is stored as {kind}, not as a float; valid: "
                             f"{', '.join(FLOAT_KINDS)} (quantized or integer checkpoints are not "
                             f"supported)")


# ---- reading the shards ---------------------------------------------------------------------------

@dataclass
class _Tally:
    """What was read: all bytes, the converted tensors read whole, and the bytes beyond the slices."""
    bytes: int = 0
    whole: list = field(default_factory=list)
    extra: int = 0

    def read(self, src, spec: ShardSpec, dtype, meta: dict) -> torch.Tensor:
        shard, nbytes, held = src.read(spec, dtype, meta)
        self.bytes += nbytes
        if src.whole:
            self.whole.append(src.target)
            _, shape, _, total = meta[src.keys[0]]
            self.extra += nbytes - held * (total // max(1, _numel(shape)))  # beyond held elements
        return shard


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _placed(device) -> torch.device:
    """``device`` as a torch.device with its index (``"cuda"``: the current GPU); None: the host."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _materialize(model, source_of: dict, meta: dict, dtypes: dict, device: torch.device) -> _Tally:
    """Replace every meta parameter by its shard read from disk, every persistent buffer by the
    checkpoint's values, all on ``device`` (the buffers a model computes itself too)."""
    reads, new_of = _Tally(), {}
    for name, p in model.named_parameters():
        spec = getattr(p, "tp_spec", None) or ShardSpec(name)
        key = spec.key if spec.key in source_of else name
        shard = reads.read(source_of[key], spec, dtypes[key], meta).to(device)
        new = nn.Parameter(shard, requires_grad=p.requires_grad)
        new.tp_replicas, new.tp_spec = p.tp_replicas, spec
        new_of[id(p)] = new
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None and id(p) in new_of:
                mod._parameters[pname] = new_of[id(p)]
    for name, b in model.named_buffers():
        if name in source_of:  # persistent
            owner, _, attr = name.rpartition(".")
            buffer = reads.read(source_of[name], ShardSpec(name), dtypes[name], meta).to(device)
            model.get_submodule(owner)._buffers[attr] = buffer
    for mod in model.modules():  # the others, computed at construction (rotary frequencies), on the host
        for attr, b in mod._buffers.items():
            if b is not None and b.device not in (device, torch.device("meta")):
                mod._buffers[attr] = b.to(device)
    return reads


@contextlib.contextmanager
def _default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _dtypes(model, dtype) -> dict:
    """``{state-dict name: dtype}`` as transformers loads it: the tensor's own (``dtype``, the
    default it was built under, unless its module fixes another: DeepSeek-V3's float32 router),
    float32 where the model's ``keep_in_fp32`` rule asks for it in a half-precision load."""
    from transformers.core_model_loading import build_glob_alternation
    out = {n: t.dtype for n, t in model.state_dict(keep_vars=True).items()}
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if plan:
        alternation, glob_of, _ = build_glob_alternation(list(plan))
        for name in out:
            hit = alternation.search(name)
            if hit:
                out[name] = plan[glob_of[hit.lastgroup]]
    return out


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
