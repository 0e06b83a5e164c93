"""``load_sharded`` on many architectures, each rank reading only its slices.

One launch of 4 ranks (tests/_checkpoint_archs_workers.py): tiny float64 checkpoints written by
``make_tiny_checkpoint`` (``save_pretrained``: the hub layout, so Mixtral's experts are stored
one tensor per expert, ``block_sparse_moe.experts.{e}.w1``, and the model's
``mlp.experts.gate_up_proj`` is built by transformers' conversion ops) are loaded at tp 2 (the
pairs [0, 1] and [2, 3] split the cases between them) and tp 4, and compared on every rank with
the dense ``from_pretrained`` model of the same directory:

- logits on fixed token ids (float64: 1e-10 relative where the whole model computes in float64;
  :data:`FLOAT32_INSIDE` says where it does not);
- every parameter's shard equals ``p.tp_spec.apply(dense_param)`` bit for bit, dtype included:
  catches experts stacked in another order (Mixtral here has 12 experts: ``experts.10`` sorts
  before ``experts.2`` as a string), gate and up halves swapped, a rank holding another rank's rows;
- each rank's ``bytes_read`` is exactly the bytes of the checkpoint elements its shards hold
  (padding rows are never read), counted again by a wrapped ``safe_open``; only the tensors the
  report names as read whole add bytes, and exactly the ones beyond this rank's slices.
"""
from pathlib import Path

import pytest
import torch

from tensorpar import distributed as dist
from tensorpar.models.tiny import make_tiny_checkpoint
from tests import _checkpoint_archs_workers as W

pytestmark = pytest.mark.multirank

# case: (model_type, sizes); the first phase's families, a BERT-like encoder, MoE with converted
# experts (deepseek_v3's first layer is dense by default on 2 layers: 1 makes layer 1 MoE), fused
# qkv / gate_up (phi3, falcon, gpt_bigcode), and two conversions beyond the experts.
CASES = {
    "llama": ("llama", {}), "gpt2": ("gpt2", {}), "bert": ("bert", {}), "roberta": ("roberta", {}),
    "mixtral": ("mixtral", {"num_local_experts": 12}), "qwen2_moe": ("qwen2_moe", {}),
    "deepseek_v3": ("deepseek_v3", {"first_k_dense_replace": 1}), "phi3": ("phi3", {}),
    "falcon": ("falcon", {}), "gpt_bigcode": ("gpt_bigcode", {}), "gemma": ("gemma", {}),
    "olmo2": ("olmo2", {}),
    "sarvam_moe": ("sarvam_moe", {}),  # query_key_value -> q, k, v by Split(0): read whole
    "olmo_hybrid": ("olmo_hybrid", {}),  # q/k/v_conv1d -> conv1d by Concatenate(0)
}
TP4 = ("llama", "gpt2", "bert", "mixtral", "qwen2_moe", "sarvam_moe")
SHARDED_FILES = {"mixtral": "200KB"}  # experts of one layer spread over several files
TOL = 1e-10
# Where the model computes in float32 inside, the split and the dense model round differently
# (sums in another order before a float32 cast): 1e-5.
FLOAT32_INSIDE = {
    "mixtral": "router softmax in float32",
    "qwen2_moe": "router softmax in float32",
    "deepseek_v3": "router linear in float32 (float32 router weight)",
    "sarvam_moe": "router linear in float32 (float32 router weight)",
    "olmo2": "q/k RMSNorm over all (split) heads in float32",
    "olmo_hybrid": "RMSNorms, rotary and linear attention in float32",
}
MERGE_CONCAT, MERGE = "MergeModulelist(dim=0) + Concatenate(dim=1)", "MergeModulelist(dim=0)"
MOE_LAYERS = {"mixtral": (0, 1), "qwen2_moe": (0, 1), "deepseek_v3": (1,), "sarvam_moe": (1,)}
READ_WHOLE = {"sarvam_moe": ("query_key_value", [f"model.layers.{i}.self_attn.{p}_proj.weight"
                                                 for i in (0, 1) for p in "qkv"])}
RUNS = [(c, 2) for c in CASES] + [(c, 4) for c in TP4]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return {case: str(make_tiny_checkpoint(root / case, arch, dtype=torch.float64,
                                           max_shard_size=SHARDED_FILES.get(case), **sizes))
            for case, (arch, sizes) in CASES.items()}


@pytest.fixture(scope="module")
def results(dirs):
    """``{(case, tp): [result of each rank that ran it]}``."""
    names = list(CASES)
    pairs = ({c: dirs[c] for c in names[0::2]}, {c: dirs[c] for c in names[1::2]})
    per_rank = dist.launch(W.archs_worker, 4, pairs, {c: dirs[c] for c in TP4}, deadline=900)
    out = {}
    for res in per_rank:
        for key, val in res.items():
            out.setdefault(key, []).append(val)
    return out


def _runs(results, case, tp):
    runs = results[(case, tp)]
    assert sorted(r["tp_rank"] for r in runs) == list(range(tp))  # every rank of the group
    return runs


@pytest.mark.parametrize("case, tp", RUNS)
def test_logits_equal_from_pretrained(results, case, tp):
    tol = 1e-5 if case in FLOAT32_INSIDE else TOL
    for run in _runs(results, case, tp):
        assert run["rel"] <= tol, (run["tp_rank"], run["rel"])


@pytest.mark.parametrize("case, tp", RUNS)
def test_each_shard_is_its_slice_of_the_dense_parameter(results, case, tp):
    for run in _runs(results, case, tp):
        assert run["wrong_shards"] == [], run["wrong_shards"][:4]
        assert run["split"] > 0  # something was split: the comparison is not trivially whole


@pytest.mark.parametrize("case, tp", RUNS)
def test_each_rank_reads_only_its_slices(results, dirs, case, tp):
    for run in _runs(results, case, tp):
        rep = run["report"]
        assert run["get_tensor_calls"] == 0
        assert run["logged_elements"] * 8 == rep["bytes_read"]  # the wrapped safe_open agrees
        assert rep["bytes_read"] - rep["extra_bytes_read"] == run["held_elements"] * 8
        if case not in READ_WHOLE:
            assert rep["read_whole"] == [] and rep["extra_bytes_read"] == 0
            continue
        fused, targets = READ_WHOLE[case]
        assert sorted(rep["read_whole"]) == sorted(targets)
        whole = _bytes_of(dirs[case], fused)  # every fused tensor read whole, once
        assert rep["extra_bytes_read"] == whole - run["held_whole_elements"] * 8 > 0


@pytest.mark.parametrize("case", list(MOE_LAYERS))
def test_experts_are_converted_by_transformers_ops(results, dirs, case):
    """The experts the report says were converted, with the ops of transformers' mapping."""
    if case in SHARDED_FILES:  # one layer's experts in several files, found through the index
        assert len(list(Path(dirs[case]).glob("*.safetensors"))) > 2
    prefix = "model.layers.{}.mlp.experts."
    want = {}
    for i in MOE_LAYERS[case]:
        want[prefix.format(i) + "gate_up_proj"] = MERGE_CONCAT
        want[prefix.format(i) + "down_proj"] = MERGE
    for run in results[(case, 2)]:
        got = {k: v for k, v in run["report"]["converted"].items() if ".experts." in k}
        assert got == want


def _bytes_of(path, fragment: str) -> int:
    """Bytes of the checkpoint tensors whose name holds ``fragment``, from the file header."""
    from safetensors import safe_open
    total = 0
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if fragment in key:
                    sl = f.get_slice(key)
                    total += torch.Size(sl.get_shape()).numel() * 8  # float64
    assert total > 0
    return total

