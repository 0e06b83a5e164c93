"""Loading safetensors checkpoints shard by shard, all-MiniLM-L6-v2, and the discovered plan.

One launch of 4 ranks (tests/_models_launch.py): tiny float32 checkpoints (llama: GQA, untied
head, split over many files with an index; gpt2: Conv1D, tied, one file) at tp 2, 3 (gpt2) and
4, each read through a wrapped ``safetensors.safe_open`` that logs every read; the real all-MiniLM-L6-v2 weights at tp 2, 3 and 4 (vocabulary 30522,
padded at tp 4); a model no plan knows under plan="auto". Bad checkpoint directories are
checked in this process: they fail before any process group is needed.

Tolerances: loaded shards must equal the in-memory ``parallelize`` shards bit for bit (the
same slices of the same numbers); float32 logits 1e-5 relative (summation order only); MiniLM
embeddings 1e-5 absolute (issue 4; they are unit vectors).
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tensorpar.models.checkpoint import load_sharded
from tensorpar.models.tiny import make_tiny_checkpoint
from tests import _models_launch, _models_workers as W

TINY = _models_launch.TINY_CHECKPOINTS


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Checkpoints of this process's own, for the bad-directory tests."""
    root = tmp_path_factory.mktemp("ckpt")
    return {f: str(make_tiny_checkpoint(root / f, f)) for f in TINY}


@pytest.fixture(scope="module")
def results():
    return _models_launch.merged("checkpoint")


@pytest.mark.multirank
@pytest.mark.parametrize("family, tp", [(f, tp) for f in TINY for tp in (2, 3, 4)
                                        if not (tp == 3 and f in W.TP3_DOES_NOT_FIT)])
def test_checkpoint_shards_equal_in_memory_shards(results, family, tp):
    runs = results[("ckpt", family, tp)]
    assert len(runs) == (4 if tp != 3 else 3)
    for run in runs:
        assert run["same_shards"]
        assert run["logits_rel"] <= 1e-5
        rep = run["report"]
        assert rep["bytes_read"] <= rep["shard_bytes"]  # only this rank's slices were read
        assert rep["bytes_read"] < rep["checkpoint_bytes"] / tp * 1.5
        if family in _models_launch.SHARDED:
            shards = [f for f in run["files"] if f.endswith(".safetensors")]
            assert "model.safetensors.index.json" in run["files"] and len(shards) > 2


@pytest.mark.multirank
@pytest.mark.parametrize("family, tp", [(f, tp) for f in TINY for tp in (2, 3, 4)
                                        if not (tp == 3 and f in W.TP3_DOES_NOT_FIT)])
def test_each_rank_reads_exactly_its_slices(results, family, tp):
    """Counted by the wrapped safe_open, not by the loader: no whole-tensor read, and the
    elements read are the elements this rank holds but the vocabulary padding rows (zeros,
    never read): ``ceil(V/tp)`` rows per rank, of which rank r owns ``min((r+1)*per, V) - r*per``."""
    per = -(-W.VOCAB // tp)
    vocab_matrices = {"llama": 2, "gpt2": 1}[family]  # gpt2's head is tied to its embedding
    runs = results[("ckpt", family, tp)]
    assert sorted(run["tp_rank"] for run in runs) == sorted(list(range(tp)) * (4 // tp))  # every rank of every group
    for run in runs:
        r = run["tp_rank"]
        padding = (per - (min((r + 1) * per, W.VOCAB) - r * per)) * 48 * vocab_matrices
        assert run["get_tensor_calls"] == 0
        assert run["elements_read"] == run["held"] - padding, (r, run["elements_read"], run["held"])


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_minilm_embeddings_equal_unsharded(results, tp):
    runs = results[("minilm", tp)]
    assert len(runs) == (3 if tp == 3 else 4)
    for run in runs:
        assert run["max_abs"] <= 1e-5, run["max_abs"]
        assert all(abs(n - 1) < 1e-6 for n in run["norms"])
        rep = run["report"]
        # about 1/tp of the parameters per rank: replicated LayerNorms, biases and the 512
        # position embeddings are ~1.5% of the model
        assert run["per_rank"] <= 1.1 * run["total"] / tp
        assert rep["bytes_read"] <= rep["shard_bytes"] <= 1.1 * rep["checkpoint_bytes"] / tp
        if run["fresh"] and rep["peak_rss_delta_bytes"] is not None:  # Linux, first load
            shard = rep["shard_bytes"]
            # private memory: the shard itself (+ allocator slack)
            assert 0.9 * shard <= rep["anon_rss_delta_bytes"] <= 1.2 * shard + 4e6
            # peak: the shard plus the mapped slices of the tensor being read (at most the
            # 1/tp slice of the 47 MB embedding), never near the 91 MB checkpoint
            assert rep["peak_rss_delta_bytes"] <= shard + 1.2 * rep["checkpoint_bytes"] / tp
            assert rep["peak_rss_delta_bytes"] < 0.6 * rep["checkpoint_bytes"]


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [2, 4])
def test_discovered_plan_pairs_checked_linears_and_equals_dense(results, tp):
    for run in results[("toy", tp)]:
        assert run["source"] == "discovered"
        assert run["rel"] <= 1e-12
        assert run["styles"] == {"emb": "vocab", "head": "vocab_head",  # each pair's parent is its region
                                 "blocks.0.mlp": "mlp", "blocks.0.mlp.fc1": "colwise", "blocks.0.mlp.fc2": "rowwise",
                                 "blocks.1.mlp": "mlp", "blocks.1.mlp.fc1": "colwise", "blocks.1.mlp.fc2": "rowwise"}
        assert any(n.startswith("not paired in extra") for n in run["notes"])
        seq = run["sequential"]  # nn.Sequential(Linear, ReLU, Linear) found and split
        assert seq["styles"] == {"0": "colwise", "2": "rowwise"}
        assert seq["types"] == ["ColumnParallelLinear", "ReLU", "RowParallelLinear"]
        assert seq["rel"] <= 1e-12 and seq["grad_rel"] <= 1e-12, seq


# ---- bad checkpoint directories (no ranks needed: they fail first) ------------------------------

def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_sharded(tmp_path / "nope")


def test_directory_without_config_or_weights(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama"], tmp_path / "a")
    (d / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        load_sharded(d)
    d = _copy(tiny_dirs["llama"], tmp_path / "b")
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_sharded(d)


def test_unknown_model_type(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama"], tmp_path / "unknown")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama_but_not"}))
    with pytest.raises(ValueError, match="unknown.: model_type 'llama_but_not' is not known to transformers"):
        load_sharded(d)
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "model_type"}))
    with pytest.raises(ValueError, match="model_type None is not known to transformers"):
        load_sharded(d)


def test_config_that_does_not_match_the_weights(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama"], tmp_path / "wide")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 192}))
    with pytest.raises(ValueError, match=r"does not match its config.json: 6 tensors have other shapes"):
        load_sharded(d)


def test_missing_tensor(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["gpt2"], tmp_path / "cut")
    tensors = load_file(d / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensors .*transformer.h.1.mlp.c_fc.weight"):
        load_sharded(d)


def test_index_naming_a_missing_file(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["gpt2"], tmp_path / "idx")
    keys = load_file(d / "model.safetensors").keys()
    index = {"weight_map": {k: "model-00001-of-00002.safetensors" for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="index names files that are missing"):
        load_sharded(d)


def test_bfloat16_checkpoint_at_tp_1_equals_from_pretrained_bit_for_bit(tmp_path):
    """No cast of float32 buffers (rotary inv_freq): the same function as transformers' own load."""
    from transformers import AutoModelForCausalLM
    d = make_tiny_checkpoint(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    model, _ = load_sharded(d)  # no process group: tp 1
    dense = AutoModelForCausalLM.from_pretrained(d).eval()
    assert next(model.parameters()).dtype == torch.bfloat16
    assert {b.dtype for b in model.buffers()} == {b.dtype for b in dense.buffers()} == {torch.float32}
    ids = torch.randint(2, W.VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, dense(input_ids=ids).logits)


def _index_of(d, weight_map):
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_bad_index(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["gpt2"], tmp_path / "nomap")
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json has no 'weight_map' .*found \['metadata'\]"):
        load_sharded(d)
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="model.safetensors.index.json is not valid JSON"):
        load_sharded(d)
    keys = sorted(load_file(d / "model.safetensors"))
    save_file({"x": torch.zeros(1)}, d / "other.safetensors", metadata={"format": "pt"})
    _index_of(d, {**{k: "model.safetensors" for k in keys}, keys[0]: "other.safetensors"})
    with pytest.raises(ValueError, match=rf"1 tensors are not in the file the index names.*{keys[0]} \(index: other"):
        load_sharded(d)


def test_truncated_weights_file(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama"], tmp_path / "cut")
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=r"cut/model.safetensors is not a readable safetensors file"):
        load_sharded(d)


def test_integer_tensor_where_a_float_is_expected(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama"], tmp_path / "int8")
    tensors = load_file(d / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight"
    tensors[key] = tensors[key].to(torch.int8)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"int8/model.safetensors: tensor '{key}' is stored as I8, not as a float; valid: F64, F32, F16, BF16"):
        load_sharded(d)


def test_bad_dtype(tiny_dirs):
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
        load_sharded(tiny_dirs["llama"], dtype=torch.int64)


def _as_hub_cache(src, root, org="org"):
    """``src`` split into two files with an index and laid out as the Hugging Face hub cache keeps
    a download: ``models--org--tiny/blobs/<sha256>`` and, in ``snapshots/<rev>/``, each file a
    symlink to ``../../blobs/<sha256>``. Returns the snapshot folder."""
    import hashlib
    tensors = load_file(src / "model.safetensors")
    keys = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": keys[:len(keys) // 2],
             "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    staging = root / "staging"
    staging.mkdir(parents=True)
    for name, part in files.items():
        save_file({k: tensors[k] for k in part}, staging / name, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())  # as the hub's indexes carry it
    (staging / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": {k: name for name, part in files.items() for k in part}}))
    shutil.copy(src / "config.json", staging / "config.json")
    repo = root / f"models--{org}--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in staging.iterdir():
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        f.rename(repo / "blobs" / sha)
        (snapshot / f.name).symlink_to(f"../../blobs/{sha}")
    staging.rmdir()
    return snapshot


def test_a_checkpoint_in_the_hub_cache_layout_loads_its_symlinked_blobs(tiny_dirs, tmp_path):
    """The layout most downloaded models have: every file a symlink into the same cache repo's
    blobs/. Loaded, it equals the plain single-file checkpoint bit for bit."""
    src = Path(tiny_dirs["llama"])
    snapshot = _as_hub_cache(src, tmp_path)
    assert all(f.is_symlink() for f in snapshot.iterdir())
    hub, _ = load_sharded(snapshot)
    plain, _ = load_sharded(src)
    for (name, a), b in zip(plain.state_dict().items(), hub.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_hub_snapshot_linking_out_of_its_own_blobs_is_refused(tiny_dirs, tmp_path):
    """A symlink to another cache repo's blobs, or out of the cache, still leaves the folder."""
    snapshot = _as_hub_cache(Path(tiny_dirs["llama"]), tmp_path)
    other = _as_hub_cache(Path(tiny_dirs["llama"]), tmp_path / "other-cache", org="other")
    link = snapshot / "model-00002-of-00002.safetensors"
    loose = shutil.copy(link.resolve(), tmp_path / "loose.safetensors")
    for target in ((other / link.name).resolve(), loose):  # a blob of models--other--tiny; a file outside
        link.unlink()
        link.symlink_to(target)
        with pytest.raises(ValueError, match=r"index.json names files outside the checkpoint folder: "
                                             r"\['model-00002-of-00002.safetensors'\]"):
            load_sharded(snapshot)


def test_per_layer_sizes_are_accepted_and_bad_ones_named(tmp_path):
    """Gemma-3n's config gives intermediate_size per layer (a list): accepted when every entry is a
    positive integer (it was refused as 'must be a positive integer'), named when one is not."""
    from tensorpar.models.checkpoint import _check_sizes
    _check_sizes({"intermediate_size": [64, 64], "num_hidden_layers": 2}, {}, tmp_path)
    for bad in ([64, 0], [], [64, 1.5], [True]):
        with pytest.raises(ValueError, match=r"intermediate_size=.* must be a positive integer"):
            _check_sizes({"intermediate_size": bad}, {}, tmp_path)
