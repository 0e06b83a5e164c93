"""tensorpar.models.conversion: checkpoint keys to model tensors through transformers' mapping,
and reading a shard through a converter's op chain. In process, no ranks.

- each chain read lazily (``MergeModulelist`` [+ ``Concatenate``], ``Concatenate``, ``Transpose``)
  gives, for shards along every dim (several pieces, across the gate/up boundary, padded), exactly
  ``spec.apply`` of what transformers' own ops build from the whole tensors, and reads only the
  elements the shard holds; any other op is read whole and gives the same;
- the checkpoint's expert tensors are taken in transformers' (natural) order, renamed keys found;
- a converted checkpoint that disagrees with its config, lacks an expert or stores one as an
  integer is refused naming the tensors; a bfloat16 load keeps transformers' float32 tensors.
"""
import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.core_model_loading import (Chunk, Concatenate, MergeModulelist, Split, Transpose,
                                             WeightConverter)

from tensorpar.models import conversion as C
from tensorpar.models.checkpoint import _tensor_index, load_sharded
from tensorpar.models.tiny import make_tiny_checkpoint
from tensorpar.sharding.spec import ShardSpec, segment_pieces

E = 12  # experts: "10" and "11" sort before "2" as strings, after "9" naturally


def _expert_keys(name: str) -> list:
    return [f"layers.0.experts.{e}.{name}.weight" for e in range(E)]


def _tensors():
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    out = {k: rand(6, 5) for k in _expert_keys("w1") + _expert_keys("w3")}  # (F, H) per expert
    out.update({k: rand(5, 6) for k in _expert_keys("w2")})  # (H, F)
    out.update({"layers.0.q.weight": rand(8, 5), "layers.0.k.weight": rand(4, 5), "layers.0.v.weight": rand(4, 5)})
    out["layers.0.packed.gate_up"] = rand(3, 5, 12)  # (E, H, 2F): transposed to (E, 2F, H)
    return out


# (converter, target, {pattern: keys}); keys in the order transformers collects them (natural)
CHAINS = {
    "merge+concat": (WeightConverter([".experts.*.w1.weight", ".experts.*.w3.weight"], ".experts.gate_up_proj",
                                     [MergeModulelist(dim=0), Concatenate(dim=1)]),
                     "layers.0.experts.gate_up_proj"),
    "merge": (WeightConverter([".experts.*.w2.weight"], ".experts.down_proj", [MergeModulelist(dim=0)]),
              "layers.0.experts.down_proj"),
    "concat": (WeightConverter(["q.weight", "k.weight", "v.weight"], "qkv.weight", [Concatenate(dim=0)]),
               "layers.0.qkv.weight"),
    "transpose": (WeightConverter("packed.gate_up", "experts.gate_up_proj", [Transpose(1, 2)]),
                  "layers.0.experts.gate_up_proj"),
    "chunk (read whole)": (WeightConverter("packed.gate_up", ["experts.gate_proj", "experts.up_proj"],
                                           [Chunk(dim=2)]), "layers.0.experts.gate_proj"),
}


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """``(tensors, headers)`` of one safetensors file holding :func:`_tensors`."""
    path = tmp_path_factory.mktemp("conv") / "model.safetensors"
    tensors = _tensors()
    save_file(tensors, str(path))
    return tensors, _tensor_index({None: path})


def _sources(name, headers):
    """The :class:`~tensorpar.models.conversion.Source` s of a chain, and its ``{pattern: keys}``
    collected as transformers collects them (in natural order)."""
    from transformers.core_model_loading import dot_natural_key
    conv, first = CHAINS[name]
    keys = {}
    for key in sorted(headers, key=dot_natural_key):
        _, pattern = conv.rename_source_key(key)
        if pattern is not None:
            keys.setdefault(pattern, []).append(key)
    shapes = {k: h[1] for k, h in headers.items()}
    return C._converted(conv, keys, first, shapes, C._DenseShapes(None, {})), keys


def _transformers_convert(name, keys, tensors) -> dict:
    """What transformers' own ops make of the whole tensors."""
    conv, first = CHAINS[name]
    conv = copy.deepcopy(conv)
    for pattern, ks in keys.items():
        for k in ks:
            conv.add_tensor(first, k, pattern, lambda k=k: tensors[k])
    return conv.convert(first)


def _specs(shape) -> list:
    """Shards along every dim: halves, thirds (padded), and two segments' halves."""
    out = [ShardSpec("t")]
    for dim, size in enumerate(shape):
        out += [ShardSpec("t", dim, ((size // 2, size),)),
                ShardSpec("t", dim, ((0, size // 3),), pad_to=size // 3 + 2)]
        if size % 4 == 0:
            out.append(ShardSpec("t", dim, segment_pieces((size // 2, size // 2), 1, 2)))
    return out


@pytest.mark.parametrize("name", list(CHAINS))
def test_shard_read_through_the_chain_equals_transformers_ops(stored, name):
    tensors, headers = stored
    sources, keys = _sources(name, headers)
    full = _transformers_convert(name, keys, tensors)
    assert {s.target for s in sources} == set(full)
    for src in sources:
        assert src.shape == tuple(full[src.target].shape)
        assert src.whole == (name == "chunk (read whole)")
        for spec in _specs(src.shape):
            if src.whole:
                src.group.results = {}  # read again for each spec
            shard, nbytes, held = src.read(spec, None, headers)
            assert torch.equal(shard, spec.apply(full[src.target])), (src.target, spec)
            whole = sum(tensors[k].numel() for ks in keys.values() for k in ks)
            assert nbytes == 8 * (whole if src.whole else held), (spec, nbytes, held)


@pytest.mark.parametrize("same_layout", [True, False])
def test_transpose_with_check_dims_follows_the_model_layout(stored, same_layout):
    """``Transpose(check_dims=True)`` leaves a tensor already in the model's shape as it is."""
    tensors, headers = stored
    conv = WeightConverter("packed.gate_up", "experts.gate_up_proj", [Transpose(1, 2, check_dims=True)])
    first, key = "layers.0.experts.gate_up_proj", "layers.0.packed.gate_up"
    model_shape = (3, 5, 12) if same_layout else (3, 12, 5)
    dense = C._DenseShapes(None, {first: torch.empty(model_shape, device="meta")})
    (src,) = C._converted(conv, {"packed.gate_up": [key]}, first, {key: headers[key][1]}, dense)
    want = tensors[key] if same_layout else tensors[key].transpose(1, 2)
    spec = ShardSpec(first, 1, ((1, 4),))
    assert src.shape == model_shape and torch.equal(src.read(spec, None, headers)[0], spec.apply(want))


def test_split_asks_the_dense_model_for_its_sizes():
    """``Split`` sizes its pieces by the model's parameters: the dense ones, not this rank's."""
    conv = WeightConverter("layers.0.qkv", ["layers.0.q", "layers.0.k"], [Split(dim=0)])
    dense = C._DenseShapes(None, {"layers.0.q": torch.empty(8, 5, device="meta"),
                                  "layers.0.k": torch.empty(4, 5, device="meta")})
    keys, shapes = {"layers.0.qkv": ["layers.0.qkv"]}, {"layers.0.qkv": (12, 5)}
    sources = C._converted(conv, keys, "layers.0.q", shapes, dense)
    assert {s.target: s.shape for s in sources} == {"layers.0.q": (8, 5), "layers.0.k": (4, 5)}
    assert all(s.whole for s in sources)  # read whole (sarvam_moe in the multi-rank tests)


# ---- the mapping of a real checkpoint -------------------------------------------------------------

@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mixtral") / "m", "mixtral", num_local_experts=E)


def _meta(path):
    from transformers import AutoConfig
    from tensorpar.sharding.model_classes import meta_model
    return meta_model(AutoConfig.from_pretrained(path))


def test_experts_are_taken_in_natural_order_and_keys_renamed(mixtral):
    headers = _tensor_index({None: mixtral / "model.safetensors"})
    shapes = {k: h[1] for k, h in headers.items()}
    sources, unexpected = C.map_checkpoint(_meta(mixtral), {**shapes, "stray.weight": (2,)})
    old = "model.layers.1.block_sparse_moe.experts.{}.{}.weight"
    gate_up = sources["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.keys == tuple(old.format(e, w) for w in ("w1", "w3") for e in range(E))
    assert gate_up.ops == "MergeModulelist(dim=0) + Concatenate(dim=1)" and not gate_up.whole
    assert sources["model.layers.1.mlp.experts.down_proj"].keys == tuple(old.format(e, "w2") for e in range(E))
    assert sources["model.layers.1.mlp.gate.weight"].keys == ("model.layers.1.block_sparse_moe.gate.weight",)
    assert unexpected == ["stray.weight"]


# ---- refusals ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_mixtral(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mixtral4") / "m", "mixtral")


def _edit(src, dst, *, drop=(), to_int=(), config=None):
    shutil.copytree(src, dst)
    tensors = {k: v for k, v in load_file(dst / "model.safetensors").items() if k not in drop}
    tensors.update({k: tensors[k].to(torch.int8) for k in to_int})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


EXPERT = "model.layers.0.block_sparse_moe.experts.3.{}.weight"


def test_converted_shape_that_disagrees_with_the_config(small_mixtral, tmp_path):
    d = _edit(small_mixtral, tmp_path / "wide", config={"intermediate_size": 192})
    with pytest.raises(ValueError, match=r"does not match its config.json: 4 tensors have other shapes, e.g. "
                                         r"\['model.layers.0.mlp.experts.gate_up_proj \(from 8 tensors by "
                                         r"MergeModulelist\(dim=0\) \+ Concatenate\(dim=1\)\): "
                                         r"checkpoint \(4, 256, 64\), model \(4, 384, 64\)"):
        load_sharded(d)


def test_missing_expert(small_mixtral, tmp_path):
    d = _edit(small_mixtral, tmp_path / "three", drop=[EXPERT.format(w) for w in ("w1", "w2", "w3")])
    with pytest.raises(ValueError, match=r"2 tensors have other shapes, e.g. \['model.layers.0.mlp.experts.gate_up_proj"
                                         r" \(from 6 tensors .*checkpoint \(3, 256, 64\), model \(4, 256, 64\)"):
        load_sharded(d)
    d = _edit(small_mixtral, tmp_path / "half", drop=[EXPERT.format("w1")])
    with pytest.raises(ValueError, match=r"checkpoint tensors \['model.layers.0.block_sparse_moe.experts.0.w1.weight'"
                                         r".* do not convert to 'model.layers.0.mlp.experts.gate_up_proj'"):
        load_sharded(d)


def test_integer_expert_where_a_float_is_expected(small_mixtral, tmp_path):
    d = _edit(small_mixtral, tmp_path / "int8", to_int=[EXPERT.format("w3")])
    with pytest.raises(ValueError, match=rf"int8/model.safetensors: tensor '{EXPERT.format('w3')}' is stored as I8, "
                                         r"not as a float"):
        load_sharded(d)


@pytest.mark.parametrize("arch, dtype, sizes, fp32", [
    # the router weight and bias: float32 in their module and in keep_in_fp32_modules_strict
    ("deepseek_v3", torch.bfloat16, {"first_k_dense_replace": 1}, "model.layers.1.mlp.gate.weight"),
    # the norms: float32 by keep_in_fp32_modules only (their module takes the default dtype)
    ("gpt_oss", torch.float16, {}, "model.layers.0.input_layernorm.weight")])
def test_half_precision_load_keeps_transformers_float32_tensors(tmp_path, arch, dtype, sizes, fp32):
    """Each tensor in the dtype ``from_pretrained`` gives it; at tp 1 the logits are those of
    transformers' own load, bit for bit."""
    import transformers
    d = make_tiny_checkpoint(tmp_path / arch, arch, dtype=dtype, **sizes)
    model, _ = load_sharded(d)
    dense = getattr(transformers, json.loads((d / "config.json").read_text())["architectures"][0])
    dense = dense.from_pretrained(d).eval()
    dtypes = lambda m: {n: t.dtype for n, t in m.state_dict().items()}  # noqa: E731
    assert dtypes(model) == dtypes(dense)
    assert dtypes(model)[fp32] == torch.float32 and next(model.parameters()).dtype == dtype
    for m in (model, dense):
        m.config._experts_implementation = "eager"
    ids = torch.randint(2, 130, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, dense(input_ids=ids).logits)
