"""Planner formulas against the closed forms they cite, and against hand counts for tiny models."""
import dataclasses
import json
import math

import pytest

from tensorpar.planner import MODEL_PRESETS, Layout, ModelSpec, get_hardware, get_model, plan
from tensorpar.planner import collectives as C
from tensorpar.planner import flops as F
from tensorpar.planner import memory as M
from tensorpar.planner import params as PR
from tensorpar.planner.comm import tp_layer_collectives
from tensorpar.planner.hfconfig import from_hf_config, from_hf_dict
from tensorpar.planner.models import default_ffn

# Tiny models whose per-rank parameters are counted by hand in the tests below.
LLAMA_TINY = ModelSpec(family="llama", layers=2, hidden=8, heads=4, kv_heads=2, head_dim=2, ffn=12, vocab=10, seq=6)
GPT_TINY = ModelSpec(family="gpt", layers=2, hidden=8, heads=2, vocab=11, seq=4)  # ffn = 4h = 32


@pytest.mark.parametrize("tp, expected", [
    # q 8x4, k/v 8x2 each, o 4x8 = 96; mlp 3 x 8x6 = 144; 2 RMSNorms 16 -> 256 per layer;
    # embedding and LM head ceil(10/2)=5 rows x 8 = 40 each; final norm 8: 2*256 + 40 + 40 + 8
    (2, 600),
    # tp=1: attention 192 + mlp 288 + norms 16 = 496 per layer; embedding 80, head 80, norm 8
    (1, 1160),
    # tp=4 > kv_heads=2: one replicated kv head per rank. q 16, k/v 16 each, o 16 = 64; mlp
    # ceil(12/4)=3 -> 72; norms 16 -> 152 per layer; vocab padded 10 -> 12: 3 rows x 8 = 24 each
    (4, 2 * 152 + 24 + 24 + 8),
])
def test_llama_tiny_params_per_device_by_hand(tp, expected):
    assert PR.params_per_device(LLAMA_TINY, tp) == expected


@pytest.mark.parametrize("tp, expected", [
    # q/k/v 8x4 each + bias 4 each = 108; o 4x8 + bias 8 (replicated) = 40; mlp 8x16 + 16x8 +
    # bias 16 + bias 8 = 280; 2 LayerNorms 32 -> 460 per layer; embedding ceil(11/2)=6 rows x 8 = 48,
    # positions 4x8 = 32 (replicated), LM head tied, final LayerNorm 16
    (2, 2 * 460 + 48 + 32 + 16),
    (1, 1880),
])
def test_gpt_tiny_params_per_device_by_hand(tp, expected):
    assert PR.params_per_device(GPT_TINY, tp) == expected


def test_gpt_count_is_narayanan_eq2_plus_final_layernorm():
    for m in (GPT_TINY, get_model("gpt3-175b"), get_model("megatron-8.3b"), get_model("megatron-1t")):
        eq2 = PR.params_narayanan_eq2(m.layers, m.hidden, m.vocab, m.seq)
        assert PR.count_params(m) == pytest.approx(eq2 + 2 * m.hidden, rel=1e-12)


@pytest.mark.parametrize("name, params", [  # the counts of the published Hugging Face checkpoints
    ("llama-2-7b", 6_738_415_616), ("llama-2-13b", 13_015_864_320), ("llama-2-70b", 68_976_648_192),
    ("llama-3-8b", 8_030_261_248), ("llama-3-70b", 70_553_706_496), ("llama-3-405b", 405_853_388_800),
])
def test_llama_presets_count_exactly(name, params):
    assert PR.count_params(get_model(name)) == params


def test_megatron_presets_match_their_names():
    for name, m in MODEL_PRESETS.items():
        if name.startswith("megatron-"):
            size = name.split("-")[1]
            billions = 1000.0 if size == "1t" else float(size[:-1])
            # names are rounded to one decimal (1.65 -> "1.7"); "1t" is 1008B (Narayanan Table 1)
            assert abs(PR.count_params(m) / 1e9 - billions) <= max(0.05, 0.01 * billions), name


def test_stage_params_split_the_model():
    m = get_model("llama-2-7b")
    stages = [PR.stage_params_per_device(m, 1, 4, s) for s in range(4)]
    assert sum(stages) == PR.count_params(m)
    tied = ModelSpec(family="gpt", layers=4, hidden=16, heads=2, vocab=32, seq=8)
    stages = [PR.stage_params_per_device(tied, 1, 2, s) for s in range(2)]
    assert sum(stages) == PR.count_params(tied) + PR.embedding_params(tied)  # last stage's copy


def test_gpt_flops_reproduce_narayanan_closed_forms():
    for m in (get_model("gpt3-175b"), get_model("megatron-8.3b"), GPT_TINY):
        b, s, l, h, v = 8, m.seq, m.layers, m.hidden, m.vocab
        closed_72 = 72 * b * s * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))
        assert F.flops_per_iteration(m, b) == pytest.approx(closed_72, rel=1e-12)
        assert F.hardware_flops_per_iteration(m, b, "full") == pytest.approx(F.narayanan_eq3_flops(l, h, v, s, b), rel=1e-12)
        assert F.hardware_flops_per_iteration(m, b, "selective") == pytest.approx(
            F.korthikanti_eq8_flops(l, h, v, s, b), rel=1e-12)
        selective = F.hardware_flops_per_iteration(m, b, "selective") - F.flops_per_iteration(m, b)
        assert selective == pytest.approx(12 * b * s**2 * h * l, rel=1e-12)  # Eq. 8 over Eq. 7


def test_selective_lower_bound_reruns_the_scores_forward_once():
    """The bound counts what must run, one forward re-run of QK^T and softmax(.)V over the
    unmasked pairs, not Eq. 8's three (see flops.py)."""
    for m in (get_model("gpt3-175b"), GPT_TINY, get_model("llama-2-7b")):
        s, a, d, l = m.seq, m.heads, m.head_dim, m.layers
        extra = F.causal_flops_per_iteration(m, 2, "selective") - F.causal_flops_per_iteration(m, 2, "none")
        assert extra == pytest.approx(2 * l * 4 * a * d * s * (s + 1) / 2, rel=1e-12)
        assert F.causal_flops_per_iteration(m, 2, "selective") < F.hardware_flops_per_iteration(m, 2, "selective")


def test_llama_flops_count_swiglu_and_gqa():
    m = get_model("llama-2-70b")
    h, a, g, d, f = m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn
    layer = F.layer_forward_flops_per_token(m, 100)
    assert layer["dense"] == 2 * h * (a * d + 2 * g * d) + 2 * a * d * h + 6 * h * f
    assert layer["attention_scores"] == 4 * 100 * a * d


def test_causal_flops_count_only_unmasked_pairs():
    m = GPT_TINY
    s, a, d, l = m.seq, m.heads, m.head_dim, m.layers
    full = F.hardware_flops_per_iteration(m, 1, "none")
    causal = F.causal_flops_per_iteration(m, 1, "none")
    masked_pairs = s * s - s * (s + 1) // 2
    assert full - causal == pytest.approx(3 * l * 4 * a * d * masked_pairs, rel=1e-12)


@pytest.mark.parametrize("rc", ["none", "selective", "full"])
@pytest.mark.parametrize("sp", [False, True])
def test_activation_count_equals_korthikanti_table2(rc, sp):
    for s, b, h, a, t in [(2048, 4, 6144, 64, 8), (1024, 1, 768, 12, 4), (512, 3, 256, 8, 2), (64, 2, 64, 4, 1)]:
        m = ModelSpec(family="gpt", layers=1, hidden=h, heads=a, vocab=8, seq=s)
        got = M.activation_bytes_per_layer(m, seq=s, micro_batch=b, tp=t, sequence_parallel=sp, recompute=rc)
        table = M.korthikanti_table2(s, b, h, a, t, sequence_parallel=sp, recompute=rc)
        if rc == "full" and sp:
            table /= t  # the stored layer input is sequence-sharded too
        assert got == pytest.approx(table, rel=1e-12), (s, b, h, a, t)


def test_llama_activations_have_no_dropout_and_shrink_with_gqa():
    mha = ModelSpec(family="llama", layers=1, hidden=512, heads=8, kv_heads=8, ffn=1024, vocab=8, seq=256)
    gqa = ModelSpec(family="llama", layers=1, hidden=512, heads=8, kv_heads=2, ffn=1024, vocab=8, seq=256)
    kw = dict(seq=256, micro_batch=1, tp=1)
    s, h, d, f = 256, 512, 64, 1024
    # per token: 4 h e (norms, block inputs) + 4 a d e (Q, K, V, o_in) + 3 f e + scores a s e, e = 2
    assert M.activation_bytes_per_layer(mha, **kw) == s * (8 * h + 8 * 8 * d + 6 * f + 8 * s * 2)
    assert M.activation_bytes_per_layer(mha, **kw) - M.activation_bytes_per_layer(gqa, **kw) == s * 2 * 6 * d * 2


def test_kv_cache_is_gqa_and_replication_aware():
    m = get_model("llama-2-70b")  # 80 layers, 8 kv heads of 128
    assert M.kv_cache_bytes_per_token(m)["total"] == 2 * 80 * 8 * 128 * 2
    kv16 = M.kv_cache_bytes_per_token(m, tp=16)
    assert kv16["per_device"] == 2 * 80 * 1 * 128 * 2  # each kv head held by 2 ranks
    assert kv16["replicated_total"] == 2 * kv16["total"] and kv16["replication"] == 2
    assert M.kv_cache_bytes_per_token(m, tp=8, pp=4)["per_device"] == 2 * 20 * 128 * 2


def test_model_states_are_16_bytes_per_parameter_and_zero_shards_them():
    for e in (2, 4):
        assert sum(M.model_state_bytes(1, bytes_per_elem=e).values()) == 16
    z = {s: M.model_state_bytes(1000, dp=4, zero_stage=s) for s in range(4)}
    assert [sum(v.values()) for v in z.values()] == [16000, 4000 + 3000, 2000 + 3500, 4000]


def test_ring_and_unavoidable_bytes():
    for p in (2, 3, 4, 8):
        assert C.ring_bytes_sent("all_reduce", 1200, p) == pytest.approx(2 * (p - 1) / p * 1200)
        assert C.ring_bytes_sent("all_gather", 1200, p) == pytest.approx((p - 1) / p * 1200)
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            assert C.unavoidable_device_bytes(op, 1200, p) <= C.ring_bytes_sent(op, 1200, p)
    assert C.ring_bytes_sent("all_reduce", 1200, 1) == 0
    with pytest.raises(ValueError, match="valid: all_reduce"):
        C.ring_bytes_sent("all_to_everyone", 1, 2)


def test_collective_bound_across_nodes_uses_the_node_links():
    n = 1e9
    # 16 ranks, 8 per node: each node must take in N over its 8 NICs
    t = C.collective_time_lower_bound("all_reduce", n, 16, per_node=8, intra_bytes_per_s=450e9, inter_bytes_per_s=50e9)
    assert t == pytest.approx(n / (8 * 50e9))
    t = C.collective_time_lower_bound("all_gather", n, 16, per_node=8, intra_bytes_per_s=450e9, inter_bytes_per_s=50e9)
    assert t == pytest.approx(0.5 * n / (8 * 50e9))
    assert C.collective_time_lower_bound("all_reduce", n, 8, per_node=8, intra_bytes_per_s=450e9,
                                         inter_bytes_per_s=50e9) == pytest.approx(n / 450e9)


def test_hardware_presets_and_custom_values():
    a100 = get_hardware("A100-SXM4-80GB")
    assert a100.name == "a100-80gb" and a100.intra_node_bytes_per_s == 300e9
    assert get_hardware("h100-pcie").intra_node_bytes_per_s == 64e9  # PCIe Gen5 x16, per direction
    assert a100.peak_flops("fp32") == 156e12 and a100.peak_flops("bf16") == 312e12
    custom = a100.with_overrides(intra_node_bytes_per_s=100e9, mem_bytes=40e9)
    assert custom.intra_node_bytes_per_s == 100e9 and custom.mem_bytes == 40e9 and custom.name.endswith("(custom)")
    with pytest.raises(ValueError, match="unknown hardware 'b200'; valid: a100-40gb"):
        get_hardware("b200")
    with pytest.raises(ValueError, match="mem_bytes"):
        a100.with_overrides(mem_bytes=-1.0)


def test_model_validation_and_defaults():
    assert default_ffn("llama", 4096) == 11008 and default_ffn("llama", 5120) == 13824
    assert default_ffn("gpt", 768) == 3072
    with pytest.raises(ValueError, match=r"layers \(0\) must be a positive integer"):
        ModelSpec(family="gpt", layers=0, hidden=8, heads=2, vocab=8, seq=4)
    with pytest.raises(ValueError, match="family .* must be one of: gpt, llama"):
        ModelSpec(family="bert", layers=1, hidden=8, heads=2, vocab=8, seq=4)
    with pytest.raises(ValueError, match="valid kv_heads: 1, 2, 4"):
        ModelSpec(family="llama", layers=1, hidden=8, heads=4, kv_heads=3, vocab=8, seq=4)
    with pytest.raises(ValueError, match="unknown model 'llama-9b'; valid: llama-2-7b"):
        get_model("llama-9b")


def test_hf_config_json(tmp_path):
    llama = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "max_position_embeddings": 8192, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    m = from_hf_config(tmp_path / "config.json")
    assert PR.count_params(m) == PR.count_params(get_model("llama-3-8b"))
    assert m.seq == 8192 and m.seq_source.startswith("max_position_embeddings")
    gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    (tmp_path / "gpt2.json").write_text(json.dumps(gpt2))
    assert PR.count_params(from_hf_config(tmp_path / "gpt2.json")) == 124_439_808  # GPT-2 small
    (tmp_path / "bert.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        from_hf_config(tmp_path / "bert.json")


def test_plan_report_is_json_and_bounds_are_consistent():
    m, hw = get_model("llama-2-13b"), get_hardware("h100-sxm")
    r = plan(m, Layout(tp=4, micro_batch=2, global_batch=8, recompute="selective", sequence_parallel=True), hw)
    d = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    for key in ("params", "params_per_device", "flops_per_iteration", "hardware_flops_per_iteration",
                "activation_bytes_per_layer", "kv_cache_bytes_per_token", "memory_per_device", "comm",
                "compute_time_lower_bound_s", "comm_time_lower_bound_s", "step_time_lower_bound_s",
                "decode_time_per_token_lower_bound_s", "decode_steps_per_s_upper_bound",
                "prefill_time_lower_bound_s", "kv_transfer_time_lower_bound_s", "feasible", "reasons", "fixes"):
        assert key in d
    assert set(d["memory_per_device"]) >= {"weights", "gradients", "optimizer", "activations", "kv_cache", "total"}
    assert r.step_time_lower_bound_s == max(r.compute_time_lower_bound_s, r.comm_time_lower_bound_s)
    assert r.compute_time_lower_bound_s == pytest.approx(
        r.flops_lower_bound_per_iteration / (4 * hw.peak_dense_bf16_flops))
    assert r.estimates["step_time_s"] >= r.step_time_lower_bound_s
    weights = r.decode_bound_terms["weight_bytes_read_per_device"]
    assert r.decode_time_per_token_lower_bound_s >= weights / hw.hbm_bytes_per_s
    assert r.decode_steps_per_s_upper_bound == pytest.approx(1 / r.decode_time_per_token_lower_bound_s)
    assert r.kv_transfer_time_lower_bound_s == pytest.approx(
        2 * 4096 * r.kv_cache_bytes_per_token["per_device"] / hw.inter_node_bytes_per_s)


def test_decode_bound_is_weight_streaming_for_one_token():
    m, hw = get_model("llama-2-70b"), get_hardware("h200")
    r = plan(m, Layout(tp=8, workload="inference"), hw)
    t = r.decode_bound_terms
    lm_head = math.ceil(m.vocab / 8) * m.hidden
    assert t["weight_bytes_read_per_device"] == 2 * (80 * PR.layer_params(m, 8) + m.hidden + lm_head)
    assert t["kv_bytes_read_per_device"] == 4096 * 2 * 80 * 1 * 128 * 2
    assert r.decode_time_per_token_lower_bound_s == pytest.approx(
        (t["weight_bytes_read_per_device"] + t["kv_bytes_read_per_device"]) / hw.hbm_bytes_per_s)


STARCODER = {"model_type": "gpt_bigcode", "n_embd": 6144, "n_head": 48, "n_layer": 40, "n_positions": 8192,
             "vocab_size": 49152, "multi_query": True, "n_inner": 24576}
MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
              "sliding_window": 4096, "tie_word_embeddings": False}  # Mistral-7B-v0.1 config.json


def test_gpt_bigcode_multi_query_shares_one_kv_head():
    m = from_hf_dict(STARCODER)
    assert m.kv_heads == 1
    # GPTBigCodeForCausalLM's parameter count for this config (the published "15.5B"); the
    # agreement test checks the same rule against transformers' modules on tiny configs
    assert PR.count_params(m) == 15_517_456_384
    assert M.kv_cache_bytes_per_token(m)["total"] == 2 * 40 * 1 * 128 * 2  # one K/V head of 128
    mha = from_hf_dict({**STARCODER, "multi_query": False})
    assert mha.kv_heads == 48 and M.kv_cache_bytes_per_token(mha)["total"] == 48 * 2 * 40 * 128 * 2
    assert from_hf_dict({k: v for k, v in STARCODER.items() if k != "multi_query"}).kv_heads == 1  # HF default


def test_unsupported_hf_types_are_refused_with_the_supported_list():
    with pytest.raises(ValueError, match=r"unsupported model_type 'openai-gpt' .*no final LayerNorm.*; "
                                         r"valid: llama, mistral, qwen2, qwen3, gpt2, gpt_bigcode"):
        from_hf_dict({"model_type": "openai-gpt", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 40478})
    with pytest.raises(ValueError, match=r"llama with mlp_bias=True .* valid: mlp_bias=false"):
        from_hf_dict({**MISTRAL_7B, "model_type": "llama", "mlp_bias": True})
    with pytest.raises(ValueError, match=r"qwen3 with attention_bias=True"):
        from_hf_dict({**MISTRAL_7B, "model_type": "qwen3", "attention_bias": True})


def test_qwen3_counts_its_q_and_k_norms():
    cfg = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
           "max_position_embeddings": 40960, "tie_word_embeddings": False}  # Qwen3-8B config.json
    m = from_hf_dict(cfg)
    assert m.qk_norm and PR.count_params(m) == 8_190_735_360  # Qwen3ForCausalLM's count ("8.2B")
    no_norm = dataclasses.replace(m, qk_norm=False)
    assert PR.count_params(m) - PR.count_params(no_norm) == 36 * 2 * 128  # q_norm, k_norm: head_dim weights each
    assert PR.params_per_device(m, 8) - PR.params_per_device(no_norm, 8) == 36 * 2 * 128  # replicated
    (qk,) = [i for i in tp_layer_collectives(m, Layout(tp=4), phase="training") if i.where == "layer.attention.qk_norm"]
    assert qk.count == 2 and qk.payload_bytes == 128 * 2  # gradients of two d-vectors, bf16


def test_sliding_window_from_hf_configs():
    m = from_hf_dict(MISTRAL_7B)
    assert (m.sliding_window, m.window_layers, m.seq) == (4096, 32, 32768)
    assert m.seq_source == "max_position_embeddings in the config"
    qwen2 = {**MISTRAL_7B, "model_type": "qwen2", "num_hidden_layers": 28, "sliding_window": 131072}
    assert from_hf_dict(qwen2).sliding_window is None  # use_sliding_window defaults to false
    on = from_hf_dict({**qwen2, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 21})
    assert (on.sliding_window, on.window_layers) == (4096, 7)  # layers 21..27
    typed = {**qwen2, "use_sliding_window": True, "sliding_window": 4096,
             "layer_types": ["full_attention"] * 20 + ["sliding_attention"] * 8}
    assert from_hf_dict(typed).window_layers == 8
    assert from_hf_dict({**MISTRAL_7B, "model_type": "llama"}).sliding_window is None  # llama has no window


def test_sliding_window_limits_decode_kv_reads_and_attention_flops():
    m, hw, b = from_hf_dict(MISTRAL_7B), get_hardware("h100-sxm"), 4
    full = dataclasses.replace(m, sliding_window=None, window_layers=None)
    r = plan(m, Layout(micro_batch=b, workload="inference"), hw)
    kv = r.kv_cache_bytes_per_token["per_device"]
    t = r.decode_bound_terms
    # a sliding-window runtime reads the window's K/V in every layer, not the 32k context
    assert t["kv_bytes_read_per_device"] == b * 4096 * kv
    assert r.decode_time_per_token_lower_bound_s == pytest.approx(
        (t["weight_bytes_read_per_device"] + b * 4096 * kv) / hw.hbm_bytes_per_s, rel=1e-12)
    # causal pairs with a window of W keys: W(W+1)/2 + (s - W) W per sequence and layer
    s, w, a, d, l = 32768, 4096, 32, 128, 32
    pairs = w * (w + 1) / 2 + (s - w) * w
    scores_windowed = 3 * l * 4 * a * d * pairs
    scores_causal = 3 * l * 4 * a * d * s * (s + 1) / 2
    assert F.causal_flops_per_iteration(full, 1, "none") - F.causal_flops_per_iteration(m, 1, "none") == \
        pytest.approx(scores_causal - scores_windowed, rel=1e-12)
    assert F.prefill_flops(full, 1, s) - F.prefill_flops(m, 1, s) == pytest.approx(
        (scores_causal - scores_windowed) / 3, rel=1e-12)
    short = dataclasses.replace(m, seq=1000)  # shorter than the window: nothing changes
    assert F.causal_flops_per_iteration(short, 1, "none") == F.causal_flops_per_iteration(
        dataclasses.replace(short, sliding_window=None, window_layers=None), 1, "none")
    # model and hardware FLOPs stay the papers' (every query against all s keys)
    assert F.flops_per_iteration(m, 1) == F.flops_per_iteration(full, 1)


def test_window_validation():
    with pytest.raises(ValueError, match=r"sliding_window \(0\) must be a positive integer"):
        ModelSpec(family="llama", layers=2, hidden=8, heads=2, vocab=8, seq=4, sliding_window=0)
    with pytest.raises(ValueError, match=r"window_layers \(3\) must be an integer from 0 to layers \(2\)"):
        ModelSpec(family="llama", layers=2, hidden=8, heads=2, vocab=8, seq=4, sliding_window=2, window_layers=3)
