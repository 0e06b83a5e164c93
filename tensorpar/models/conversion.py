"""Which checkpoint tensors make each model tensor, and how to read only a shard's rows of them.

transformers 5 loads a checkpoint through the model's conversion mapping
(``transformers.conversion_mapping.get_model_conversion_mapping``): ``WeightRenaming`` s rename
keys (Mixtral: ``block_sparse_moe`` -> ``mlp``), and a ``WeightConverter`` builds a model tensor
from checkpoint tensors with a chain of ops. Mixtral's ``experts.gate_up_proj`` ``(E, 2F, H)`` is
``MergeModulelist(0)`` (each expert's ``w1``, and each expert's ``w3``, stacked over experts) then
``Concatenate(1)``: per expert ``[w1 | w3]``. :func:`map_checkpoint` runs transformers' own
renaming over the checkpoint's keys, in transformers' order (natural order of the names: expert
10 after expert 9), and gives every model tensor a :class:`Source`.

A source's ``get(index)`` returns that block of the (converted) model tensor, so
``ShardSpec.take`` reads a shard through it unchanged:

- a plain or renamed tensor: ``safe_open(...).get_slice(key)[index]``;
- ``MergeModulelist`` (then ``Concatenate``), ``Concatenate``, ``Transpose``: the index is carried
  back through the chain (:class:`_Stack`, :class:`_Cat`, :class:`_Transposed`) to the rows of the
  checkpoint tensors it covers, and only those are read;
- any other op: the sources are read whole, the converter's own ops build the whole tensor, and
  the shard is cut from it (``Source.whole``; the loader reports the extra bytes).

Every converted shape is what the converter's own ops give on meta tensors of the sources'
shapes, so a checkpoint that disagrees with its config is refused before a byte is read.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field

import torch


# ---- lazy blocks of a converted tensor ------------------------------------------------------------
# ``ranges``: one ``(start, stop)`` per dim of the node's shape.

class _File:
    """One checkpoint tensor."""

    def __init__(self, key: str, shape: tuple):
        self.key, self.shape = key, tuple(shape)

    def get(self, ranges, reads) -> torch.Tensor:
        sl = reads.slice(self.key)
        return sl[tuple(slice(a, b) for a, b in ranges)] if ranges else sl[:]


class _Stack:
    """``torch.stack(parts, dim)`` (``MergeModulelist``): a range of ``dim`` picks the parts."""

    def __init__(self, parts: list, dim: int):
        inner = parts[0].shape
        self.parts, self.dim = parts, dim % (len(inner) + 1)
        self.shape = inner[:dim] + (len(parts),) + inner[dim:]

    def get(self, ranges, reads) -> torch.Tensor:
        start, stop = ranges[self.dim]
        inner = ranges[:self.dim] + ranges[self.dim + 1:]
        return torch.stack([p.get(inner, reads) for p in self.parts[start:stop]], self.dim)


class _Cat:
    """``torch.cat(parts, dim)`` (``Concatenate``): a range of ``dim`` reads the parts it overlaps."""

    def __init__(self, parts: list, dim: int):
        self.parts, self.dim = parts, dim % len(parts[0].shape)
        shape = list(parts[0].shape)
        shape[self.dim] = sum(p.shape[self.dim] for p in parts)
        self.shape = tuple(shape)

    def get(self, ranges, reads) -> torch.Tensor:
        start, stop = ranges[self.dim]
        blocks, offset = [], 0
        for part in self.parts:
            width = part.shape[self.dim]
            lo, hi = max(start, offset), min(stop, offset + width)
            if lo < hi:
                sub = list(ranges)
                sub[self.dim] = (lo - offset, hi - offset)  # the range in this part's own rows
                blocks.append(part.get(sub, reads))
            offset += width
        assert blocks, (ranges, self.shape)
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, self.dim)


class _Transposed:
    """``part.transpose(dim0, dim1)`` (``Transpose``): the two ranges swap before reading."""

    def __init__(self, part, dim0: int, dim1: int):
        dim0, dim1 = dim0 % len(part.shape), dim1 % len(part.shape)
        self.part, self.dims = part, (dim0, dim1)
        shape = list(part.shape)
        shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
        self.shape = tuple(shape)

    def get(self, ranges, reads) -> torch.Tensor:
        d0, d1 = self.dims
        sub = list(ranges)
        sub[d0], sub[d1] = sub[d1], sub[d0]
        return self.part.get(sub, reads).transpose(d0, d1)


def _ranges(index: tuple, shape: tuple) -> list:
    """``[(start, stop)]`` per dim of a basic-slice ``index`` (``()``: the whole tensor)."""
    out = []
    for d, size in enumerate(shape):
        start, stop, step = (index[d] if d < len(index) else slice(None)).indices(size)
        assert step == 1, index  # ShardSpec.take asks for contiguous ranges only
        out.append((start, stop))
    return out


class _Reads:
    """The checkpoint files open while one model tensor is read; counts the bytes copied out."""

    def __init__(self, headers: dict, stack: contextlib.ExitStack):
        self.headers, self.stack, self.files, self.bytes = headers, stack, {}, 0

    def slice(self, key: str):
        from safetensors import safe_open  # looked up at call time: tests wrap it to log reads
        file = self.headers[key][0]
        if file not in self.files:
            self.files[file] = self.stack.enter_context(safe_open(str(file), framework="pt"))
        return _Counted(self.files[file].get_slice(key), self)


class _Counted:
    def __init__(self, sl, reads: _Reads):
        self.sl, self.reads = sl, reads

    def __getitem__(self, index) -> torch.Tensor:
        block = self.sl[index]  # a view of the mapped file where possible
        self.reads.bytes += block.numel() * block.element_size()
        return block


# ---- sources ----------------------------------------------------------------------------------------

@dataclass
class Source:
    """How the model tensor ``target`` is made from the checkpoint tensors ``keys``.

    ``node``: the lazy chain :meth:`read` slices through (None: ``group`` realizes the whole
    tensor with the converter's ops); ``ops``: the converter's op chain (empty: a plain or renamed
    tensor)."""
    target: str
    keys: tuple
    shape: tuple
    node: object = None
    group: "_Whole | None" = None
    ops: str = ""

    @property
    def whole(self) -> bool:
        return self.node is None

    def read(self, spec, dtype, headers: dict) -> tuple[torch.Tensor, int, int]:
        """``(shard, bytes read from the checkpoint, elements of the dense tensor in the shard)``."""
        held = [0]
        with contextlib.ExitStack() as stack:
            reads = _Reads(headers, stack)
            if self.node is not None:
                def get(index):
                    block = self.node.get(_ranges(index, self.shape), reads)
                    held[0] += block.numel()
                    return block
                shard = spec.take(get, dtype)
            else:
                full = self.group.realize(self.target, reads, dtype)

                def get(index):
                    block = full[index]
                    held[0] += block.numel()
                    return block
                shard = spec.take(get, dtype)
        return shard, reads.bytes, held[0]


@dataclass
class _Whole:
    """A converter whose ops cannot be sliced through: its sources read whole, its ops run once
    for all its targets (``Chunk``: q, k and v from one ``qkv``), each result handed out once."""
    converter: object
    keys: dict  # {source pattern: [checkpoint keys]} in transformers' order
    first: str  # the target transformers keys the conversion on
    shapes: object  # stands in for the model: the dense parameters' meta tensors
    results: dict = field(default_factory=dict)

    def realize(self, target: str, reads: _Reads, dtype) -> torch.Tensor:
        if not self.results:
            conv = copy.deepcopy(self.converter)
            for pattern, keys in self.keys.items():
                for key in keys:
                    whole = reads.slice(key)[:]
                    conv.add_tensor(self.first, key, pattern, functools.partial(_cast, whole, dtype))
            self.results = conv.convert(self.first, model=self.shapes, config=self.shapes.config)
        return self.results.pop(target)


def _cast(tensor, dtype):
    """A copy (no view of a file closed once this target is read; the results may outlive it),
    cast first, as transformers casts before converting."""
    return tensor.to(dtype or tensor.dtype, copy=True)


class _DenseShapes:
    """What a converter's op may ask of the model (``Split``, ``Transpose(check_dims=True)``):
    the dense parameter of a name, from the meta model as it was before ``parallelize``."""

    def __init__(self, config, params: dict):
        self.config, self.params = config, params

    def get_parameter(self, name: str):
        return self.params[name]


# ---- mapping the checkpoint's keys --------------------------------------------------------------------

def map_checkpoint(model, shapes: dict) -> tuple[dict, list]:
    """``({model tensor name: Source}, [checkpoint keys no model tensor takes])`` of a dense
    (meta) ``model`` and a checkpoint's ``{key: shape}``, renamed and grouped as
    ``transformers.core_model_loading.convert_and_load_state_dict_in_model`` does."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    state, prefix = model.state_dict(keep_vars=True), model.base_model_prefix
    plain, grouped, unexpected = {}, {}, []
    for key in sorted(shapes, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if target not in state and key in state:  # a name transformers would not have renamed
            target, pattern = rename_source_key(key, [], [], prefix, state)
        if target not in state:
            unexpected.append(key)
        elif pattern is None:
            plain.setdefault(target, key)  # several keys for one name: the first (transformers' rule)
        else:
            conv, keys = grouped.setdefault(target, (by_pattern[pattern], {}))
            keys.setdefault(pattern, []).append(key)
    sources = {t: Source(t, (k,), tuple(shapes[k]), _File(k, shapes[k])) for t, k in plain.items()}
    dense = _DenseShapes(model.config, state)
    for first, (conv, keys) in grouped.items():
        for src in _converted(conv, keys, first, shapes, dense):
            sources.setdefault(src.target, src)
    return sources, unexpected


def _converted(conv, keys: dict, first: str, shapes: dict, dense: _DenseShapes) -> list:
    """The :class:`Source` of each model tensor one converter makes from ``keys``."""
    out_shapes = _meta_convert(conv, keys, first, shapes, dense)
    ops = " + ".join(repr(op) for op in conv.operations)
    flat = tuple(k for p in conv.source_patterns if p in keys for k in keys[p])
    node = _chain(conv, keys, shapes, dense.params.get(first)) if len(out_shapes) == 1 else None
    if node is not None:
        target, shape = next(iter(out_shapes.items()))
        assert node.shape == shape, (target, node.shape, shape)  # our chain = transformers' ops
        return [Source(target, flat, shape, node, ops=ops)]
    group = _Whole(conv, keys, first, dense)
    return [Source(t, flat, shape, group=group, ops=ops) for t, shape in out_shapes.items()]


def _meta_convert(conv, keys: dict, first: str, shapes: dict, dense: _DenseShapes) -> dict:
    """``{model tensor name: shape}``: the converter's own ops run on meta tensors of the sources."""
    conv = copy.deepcopy(conv)
    for pattern, ks in keys.items():
        for k in ks:
            conv.add_tensor(first, k, pattern, functools.partial(torch.empty, shapes[k], device="meta"))
    try:
        out = conv.convert(first, model=dense, config=dense.config)
    except Exception as exc:  # noqa: BLE001 - any op failure means the sources do not fit together
        raise ValueError(f"checkpoint tensors {[k for ks in keys.values() for k in ks][:4]} do not convert "
                         f"to {first!r} with {conv.operations} ({type(exc).__name__}: {exc})") from None
    return {name: tuple((t[0] if isinstance(t, list) else t).shape) for name, t in out.items()}


def _chain(conv, keys: dict, shapes: dict, dense_param) -> object | None:
    """The lazy node of an op chain that can be sliced through, else None."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose
    kinds = tuple(type(op) for op in conv.operations)
    patterns = [p for p in conv.source_patterns if p in keys]  # Concatenate's order: the converter's
    files = {p: [_File(k, shapes[k]) for k in keys[p]] for p in patterns}
    if kinds in ((MergeModulelist,), (MergeModulelist, Concatenate)):
        stacked = [_Stack(files[p], conv.operations[0].dim) for p in patterns]
        if len(kinds) == 1:
            return stacked[0] if len(stacked) == 1 else None
        return _Cat(stacked, conv.operations[1].dim)
    if kinds == (Concatenate,):
        return _Cat([f for p in patterns for f in files[p]], conv.operations[0].dim)
    if kinds == (Transpose,) and len(patterns) == 1 and len(files[patterns[0]]) == 1:
        op, part = conv.operations[0], files[patterns[0]][0]
        if op.check_dims and dense_param is not None and part.shape == tuple(dense_param.shape):
            return part  # already in the model's layout: transformers leaves it as it is
        return _Transposed(part, op.dim0, op.dim1)
    return None
