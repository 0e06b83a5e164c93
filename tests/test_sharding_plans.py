"""Plans, feasibility, the checked auto-pairing and bad input, in this process (no ranks).

Without a process group every tp size is 1, which is enough for what fails before any
collective: ``parallelize`` checks and builds everything before it touches the model, so each
error case also checks that the model is exactly as it was (parameters, module types, hooks,
head attributes).
"""
import pytest
import torch
from torch import nn

from tensorpar.apply import parallelize
from tensorpar.models.generation import generate
from tensorpar.models.tiny import make_tiny_config, make_tiny_model
from tensorpar.architecture import registry
from tensorpar.architecture.plans import compile_plan, match_style
from tensorpar.architecture.tp_rules import Dims
from tensorpar.sharding import discover
from tensorpar.sharding.check import check_feasibility
from tensorpar.sharding.spec import ShardSpec
from tensorpar.sharding.styles import STYLE_NAMES
from tensorpar.models.training import clip_grad_norm_
from tensorpar.nn import ColumnParallelLinear
from tests import _models_checkpoint_workers as C, _models_workers as W
from tests.test_models_parallelize import expected_params_per_rank


# ---- feasibility ----------------------------------------------------------------------------------

def test_feasibility_lists_valid_tp_sizes_and_fixes():
    rep = check_feasibility(make_tiny_config("llama"), 3)  # 4 heads, 2 KV heads
    assert not rep.ok and rep.valid_tp_sizes == [1, 2, 4]
    assert rep.error_message() == (
        "tp_size (3) does not fit this llama model: tp_size (3) must divide n_heads (4); "
        "tp_size (3) must divide n_kv_heads (2) or be a multiple of it; valid tp sizes: 1, 2, 4")
    rep = check_feasibility(make_tiny_config("llama"), 4)
    assert rep.ok and len(rep.fixes) == 2  # KV-head replication and vocabulary padding
    assert {c.name: c.status for c in rep.constraints} == {
        "heads": "split", "kv_heads": "replicated", "ffn": "split", "vocab": "padded", "hidden": "whole"}
    assert rep.to_dict()["ok"] is True


def test_feasibility_of_sizes():
    llama3_8b = Dims(n_heads=32, n_kv_heads=8, head_dim=128, ffn=14336, vocab=128256, hidden=4096)
    assert check_feasibility(llama3_8b, 8).valid_tp_sizes == [1, 2, 4, 8, 16, 32]
    odd_ffn = Dims(n_heads=8, n_kv_heads=8, head_dim=8, ffn=100, vocab=50, hidden=64)
    rep = check_feasibility(odd_ffn, 8)
    assert "tp_size (8) must divide the MLP width ffn (100)" in rep.error_message()
    assert rep.valid_tp_sizes == [1, 2, 4]


def test_feasibility_bad_input():
    with pytest.raises(ValueError, match="tp_size must be a positive integer, got 0"):
        check_feasibility(make_tiny_config("gpt2"), 0)
    with pytest.raises(ValueError, match="plan='auto' on it needs example_inputs"):
        check_feasibility(nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match="model type 'not_a_model' is not known to transformers"):
        make_tiny_config("not_a_model")


def test_feasibility_comes_from_the_plan_of_any_architecture():
    """The constraints are the plan's own split sizes: a mixture of experts adds its experts'
    width, Phi-3's fused qkv its heads, and nothing else is asked of a replicated block."""
    rep = check_feasibility(make_tiny_config("mixtral"), 3)  # 4 heads, 2 KV heads, experts 128 wide
    assert "must divide n_heads (4)" in rep.error_message() and rep.valid_tp_sizes == [1, 2, 4]
    assert check_feasibility(make_tiny_config("phi3"), 4).ok
    assert check_feasibility(make_tiny_config("gpt_bigcode"), 4).ok  # one KV head: replicated


# ---- plans and specs -----------------------------------------------------------------------------

def test_patterns_match_one_component_per_star():
    plan = compile_plan({"layers.*.mlp": "mlp", "layers.*.mlp.up_proj": "colwise"}, STYLE_NAMES)
    assert match_style(plan, ("layers.0.mlp", None)) == ("layers.*.mlp", "mlp")
    assert match_style(plan, ("model.layers.0.mlp.up_proj", "layers.0.mlp.up_proj"))[1] == "colwise"
    assert match_style(plan, ("layers.0.x.mlp", None)) is None
    with pytest.raises(ValueError, match="style 'diagonal' is not one of colwise"):
        compile_plan({"a": "diagonal"}, STYLE_NAMES)


def test_shard_spec_pieces_padding_and_transpose():
    full = torch.arange(24.0).reshape(4, 6)
    spec = ShardSpec("w", 1, ((0, 2), (4, 5)), pad_to=4, transpose=True)
    want = torch.cat([full[:, 0:2], full[:, 4:5], torch.zeros(4, 1)], dim=1).t()
    got = spec.apply(full)
    assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(ShardSpec("w").apply(full), full)
    assert torch.equal(ShardSpec("b", 0, ((1, 3),)).apply(torch.arange(5.0)), torch.tensor([1.0, 2.0]))


# ---- parallelize: bad input, nothing half-applied -----------------------------------------------------

def _fails_unchanged(model, match, **kw):
    snap = W._snapshot(model)
    with pytest.raises(ValueError, match=match):
        parallelize(model, **kw)
    assert W.unchanged(model, snap)


def test_bad_plans_raise_and_leave_the_model_unchanged():
    model = make_tiny_model("llama")
    _fails_unchanged(model, "plan 'foo' is not supported; valid: 'auto', 'declared', an architecture", plan="foo")
    _fails_unchanged(model, "plan 'gpt2' does not fit this model", plan="gpt2")
    _fails_unchanged(model, r"plan patterns \['nope'\] match no module",
                     plan={"layers.*.mlp.up_proj": "colwise", "nope": "rowwise"})
    # the MLP entries build fine; the last fails: none of them must have been applied
    mlp = {"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
           "layers.*.mlp.down_proj": "rowwise"}
    _fails_unchanged(model, "needs an nn.Embedding but module 'model.norm' is LlamaRMSNorm",
                     plan={**mlp, "norm": "vocab"})
    _fails_unchanged(model, r"colwise_kv 'model.layers.0.self_attn.k_proj' has no rowwise partner in "
                     r"'model.layers.0.self_attn'.*'layers.\*.self_attn': 'attention' \(plan: 'replicate'\)",
                     plan={"layers.*.self_attn.k_proj": "colwise_kv"})


def test_head_styles_need_a_family_and_an_attention_module():
    _fails_unchanged(nn.Sequential(nn.Linear(4, 4)), "need the model's head counts",
                     plan={"0": "colwise_kv"})
    _fails_unchanged(make_tiny_model("gpt2"), r"missing or different: 'h.\*.attn': 'attention'",
                     plan={"h.*.attn.c_attn": "conv1d_qkv", "h.*.attn.c_proj": "conv1d_rowwise"})


def test_tied_parameters_need_matching_styles():
    model = make_tiny_model("qwen2")  # lm_head tied to embed_tokens
    _fails_unchanged(model, "lm_head.weight is tied to model.embed_tokens.weight", plan={"embed_tokens": "vocab"})


def test_unknown_models():
    _fails_unchanged(nn.Sequential(nn.Linear(4, 4)), "needs example_inputs")
    _fails_unchanged(nn.Sequential(nn.LayerNorm(4)), "unsupported model type 'Sequential'",
                     example_inputs=torch.ones(2, 4))
    with pytest.raises(ValueError, match="must be a torch.nn.Module"):
        parallelize("llama")


def test_parallelize_twice_is_an_error():
    model = parallelize(make_tiny_model("gpt2"))  # tp 1: builds without collectives
    assert model.tp_report.tp_size == 1 and model.tp_report.source == "tensorpar"
    assert model.tp_report.params_per_rank == model.tp_report.params_total
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize(model)
    model = make_tiny_model("llama")
    parallelize(model.model)
    with pytest.raises(ValueError, match=r"already parallelized \(its submodule 'model' has a tp_report\)"):
        parallelize(model)
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    seq[0] = ColumnParallelLinear.from_dense(seq[0])
    _fails_unchanged(seq, r"already parallelized \(its submodule '0' is a ColumnParallelLinear\)",
                     example_inputs=torch.ones(2, 4))


# ---- plans that would compute another function, or fail mid-forward ---------------------------

def test_attention_split_needs_the_whole_attention_block():
    """q split alone mixes up heads silently (the reviewer measured logits off by 0.39 at tp 2)."""
    model = make_tiny_model("llama")
    _fails_unchanged(model, r"plan splits \['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.o_proj'\] "
                     r"but not the whole llama attention block 'model.layers.0.self_attn'.*missing or different: "
                     r"'layers.\*.self_attn': 'attention' \(plan: 'replicate'\), 'layers.\*.self_attn.k_proj': "
                     r"'colwise_kv' \(plan: 'replicate'\), 'layers.\*.self_attn.v_proj'",
                     plan={"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"})
    _fails_unchanged(model, r"missing or different: 'layers.\*.self_attn.q_proj': 'colwise'",
                     plan={"layers.*.self_attn": "attention"})
    _fails_unchanged(make_tiny_model("gpt2"), r"'h.\*.attn.c_proj': 'conv1d_rowwise' \(plan: 'replicate'\)",
                     plan={"h.*.attn": "attention", "h.*.attn.c_attn": "conv1d_qkv"})
    # plain colwise on K/V is the same split as colwise_kv when tp divides the KV heads (tp 1)
    attn = {f"layers.*.self_attn.{n}": "colwise" for n in ("q_proj", "k_proj", "v_proj")}
    plan = {"layers.*.self_attn": "attention", **attn, "layers.*.self_attn.o_proj": "rowwise"}
    assert parallelize(make_tiny_model("llama"), plan=plan).tp_report.source == "user"


def test_a_column_split_needs_its_row_partner():
    model = make_tiny_model("llama")
    _fails_unchanged(model, r"colwise 'model.layers.0.mlp.gate_proj' has no rowwise partner in "
                     r"'model.layers.0.mlp'; add one or use 'replicate'.*'layers.\*.mlp.down_proj': 'rowwise'",
                     plan={"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.gate_proj": "colwise"})
    _fails_unchanged(model, r"missing or different: 'layers.\*.mlp.gate_proj': 'colwise'",
                     plan={"layers.*.mlp": "mlp", "layers.*.mlp.up_proj": "colwise",
                           "layers.*.mlp.down_proj": "rowwise"})
    bert = make_tiny_model("bert")  # the row partner sits outside the module of the column linear
    _fails_unchanged(bert, r"colwise 'bert.encoder.layer.0.intermediate.dense' has no rowwise partner",
                     plan={"encoder.layer.*.intermediate.dense": "colwise"})
    ok = {"encoder.layer.*.intermediate.dense": "colwise", "encoder.layer.*.output.dense": "rowwise"}
    assert parallelize(bert, plan=ok).tp_report.styles["bert.encoder.layer.1.output.dense"] == "rowwise"


def test_unknown_models_pair_siblings():
    def seq():
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    _fails_unchanged(seq(), r"colwise '0' has no rowwise partner in '<model>'; add one or use 'replicate'",
                     plan={"0": "colwise"})
    _fails_unchanged(seq(), r"rowwise '2' has no colwise partner in '<model>'", plan={"2": "rowwise"})
    block = nn.Sequential(nn.Sequential(*seq(), nn.Linear(4, 4)))  # a linear after the pair
    _fails_unchanged(block, r"region style 'mlp' on '0' needs every linear inside it split.*\['0.3'\]",
                     plan={"0": "mlp", "0.0": "colwise", "0.2": "rowwise"})
    model = parallelize(seq(), plan={"0": "colwise", "2": "rowwise"})
    assert [type(m).__name__ for m in model] == ["ColumnParallelLinear", "ReLU", "RowParallelLinear"]


def test_registry_plans_pass_their_own_checks():
    """Taken as a user's plan, each family plan passes the checks a user's plan must pass."""
    for name in ("gpt2", "bert"):
        model = make_tiny_model(name)
        plan = {k: v for k, v in registry.ARCHS[name].plan.items() if _matches(model, k)}
        assert parallelize(model, plan=plan).tp_report.source == "user"


def _matches(model, pattern) -> bool:
    from tensorpar.architecture.plans import relative_names
    from tensorpar.sharding.records import base_prefix
    rx = compile_plan({pattern: "replicate"}, STYLE_NAMES)
    return any(match_style(rx, relative_names(n, base_prefix(model))) for n, _ in model.named_modules())


def test_closed_form_parameter_count_at_tp_1_is_the_dense_count():
    """The formula the multi-rank tests check each rank against, checked here at tp 1."""
    for name in (*W.FAMILIES, *W.VARIANTS):
        model = W.tiny(name)
        family = W.VARIANTS.get(name, (name,))[0]
        assert expected_params_per_rank(model.config, family, 1) == sum(p.numel() for p in model.parameters())


# ---- the checked auto-pairing --------------------------------------------------------------------

def test_example_inputs_that_do_not_fit_the_model():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    _fails_unchanged(seq, r"example_inputs do not run through Sequential: RuntimeError: mat1 and mat2",
                     example_inputs=torch.ones(2, 5))


def test_find_pairs_restores_each_modules_own_mode():
    model = C.Toy().double().train()
    model.blocks[1].eval()  # a module in eval mode inside a model in train mode
    before = [m.training for m in model.modules()]
    ids = torch.randint(0, C.Toy.VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    discover.find_pairs(model, 2, (ids,))
    assert [m.training for m in model.modules()] == before

def test_find_pairs_checks_each_candidate():
    ids = torch.randint(0, C.Toy.VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    styles, notes = discover.find_pairs(C.Toy().double(), 2, (ids,))
    assert styles == {"blocks.0.mlp.fc1": "colwise", "blocks.0.mlp.fc2": "rowwise", "blocks.0.mlp": "mlp",
                      "blocks.1.mlp.fc1": "colwise", "blocks.1.mlp.fc2": "rowwise", "blocks.1.mlp": "mlp"}
    assert any(n.startswith("not paired in extra: extra.fc1 -> extra.fc2 (a shard run failed)") for n in notes)


def test_find_pairs_recovers_the_llama_plan():
    model = make_tiny_model("llama")
    styles, _ = discover.find_pairs(model, 2, model.dummy_inputs)
    for layer in (0, 1):
        attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        assert {k: v for k, v in styles.items() if k.startswith((attn, mlp))} == {
            attn + "q_proj": "colwise", attn + "k_proj": "colwise", attn + "v_proj": "colwise",
            attn + "o_proj": "rowwise", mlp + "gate_proj": "colwise", mlp + "up_proj": "colwise",
            mlp + "down_proj": "rowwise"}
        assert styles[attn[:-1]] == styles[mlp[:-1]] == "mlp"  # each block enters the region once


# ---- helpers: bad input ---------------------------------------------------------------------------

def test_generate_and_clip_bad_input():
    model = make_tiny_model("llama")
    ids = torch.ones(1, 3, dtype=torch.long)
    bad = [
        ((torch.ones(1, 3), 2), {}, r"input_ids must be a non-empty \(batch, seq\) torch.long tensor"),
        (([[1, 2], []], 2), {}, "non-empty list of non-empty lists"),
        (([[1, 2.5]], 2), {}, "non-empty list of non-empty lists"),
        (([[1, 999]], 2), {}, r"token ids must be in \[0, "),
        ((ids, -1), {}, "max_new_tokens must be a non-negative integer, got -1"),
        ((ids, 2), {"attention_mask": torch.ones(1, 4)}, "attention_mask must be a tensor of input_ids' shape"),
        ((ids, 2), {"attention_mask": torch.tensor([[1, 0, 1]])}, "attention_mask must be left padding"),
        ((ids, 2), {"attention_mask": torch.tensor([[0.5, 1.0, 1.0]])}, "attention_mask must hold 0 and 1 only"),
        ((ids, 2), {"attention_mask": torch.tensor([[1, 1, 0]])}, "attention_mask must be left padding"),
        (([[1, 2]], 2), {"attention_mask": torch.ones(1, 2)}, "attention_mask goes with an input_ids tensor"),
        ((ids, 2), {"do_sample": True, "temperature": 0}, "temperature must be a positive finite number, got 0"),
        ((ids, 2), {"do_sample": True, "top_k": 0}, "top_k must be a positive integer or None, got 0"),
        ((ids, 2), {"do_sample": True, "top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ((ids, 2), {"do_sample": True, "seed": -1}, r"seed must be an integer in \[0, 2\*\*63\), got -1"),
        ((ids, 2), {"do_sample": "yes"}, "do_sample must be True or False"),
        ((ids, 2), {"eos_token_id": [1, 10_000]}, "eos_token_id must be a token id or a list of them"),
        ((ids, 2), {"pad_token_id": -1}, r"pad_token_id must be a token id in \[0, "),
    ]
    for args, kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            generate(model, *args, **kwargs)
    with pytest.raises(ValueError, match="max_norm must be positive"):
        clip_grad_norm_(model, 0.0)
    with pytest.raises(ValueError, match="no parameter has a gradient"):
        clip_grad_norm_(model, 1.0)


def test_a_split_style_on_a_non_linear_module_names_the_type_first():
    model = make_tiny_model("llama")
    _fails_unchanged(model, r"plan style 'colwise' needs a Linear .* 'model.norm' is LlamaRMSNorm",
                     plan={"model.norm": "colwise"})
    assert not hasattr(model, "tp_report")
    # the builders' own rule: a GPT-2 Conv1D takes the conv1d_ styles, not 'colwise'
    _fails_unchanged(make_tiny_model("gpt2"), r"plan style 'colwise' needs a Linear .* is Conv1D",
                     plan={"transformer.h.0.mlp.c_fc": "colwise"})


# ---- declared plans, the registry, the resolution of real architectures ------------------------

def test_every_declared_style_is_translated_or_named_as_untranslated():
    """Nothing a model declares is dropped silently: each of transformers' styles maps to one of
    tensorpar's or leaves its block whole with a reason."""
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    from tensorpar.sharding import declared
    for style in ALL_PARALLEL_STYLES:
        for is_param in (False, True):
            ours, why = declared.translate(style, is_param)
            assert (ours in STYLE_NAMES or ours == "experts") != bool(why), (style, is_param, ours, why)


def test_registry_entries_name_modules_their_models_have():
    """A registry plan or override whose patterns match nothing in its own model is stale."""
    from tensorpar.sharding.declare import choose, translate
    from tensorpar.sharding.resolve import expand
    for name in ("gpt2", "bert", "bloom", "falcon", "mpt", "gpt_bigcode", "opt", "phi3", "gpt_oss", "olmo2",
                 "lfm2", "bitnet", "persimmon", "stablelm", "biogpt", "bart"):
        model = make_tiny_model(name)
        source, entries, overrides, segments = choose(model, "auto")
        if source == "declared":
            entries, _ = translate(model, entries, overrides)
        placements, unused = expand(model, entries, segments, source=source)
        own = registry.ARCHS[name]
        mine = set(own.overrides) | (set(own.plan) if isinstance(own.plan, dict) else set())
        prefix = getattr(model, "base_model_prefix", "") + "."
        stale = [p for p in unused if p in mine or p[len(prefix):] in mine]
        assert placements and not [p for p in stale if _matches_nothing_expected(name, p)], (name, stale)


def _matches_nothing_expected(name, pattern) -> bool:
    # shared plans name heads that only some classes have (a BERT plan serves BertLMHeadModel and
    # RoBERTa's lm_head); an entry matching nothing in its own tiny model is stale otherwise
    return pattern.split(".")[-1] not in ("decoder", "generator_lm_head", "output_projection", "proj_out",
                                          "lm_head", "wte", "tokens_embed")


def _styles(arch, tp=2, **sizes):
    from tensorpar.sharding.declare import declare
    from tensorpar.sharding.resolve import resolve
    model = make_tiny_model(arch, **sizes)
    return resolve(model, declare(model, "auto"), tp).styles()


def test_resolution_of_fused_projections_and_mixtures_of_experts():
    phi3 = _styles("phi3")  # declared gathered; tensorpar splits each fused segment
    assert phi3["model.layers.0.self_attn.qkv_proj"] == phi3["model.layers.0.mlp.gate_up_proj"] == "fused_colwise"
    assert phi3["model.layers.0.self_attn"] == "attention" and phi3["model.layers.0.self_attn.o_proj"] == "rowwise"
    moe = _styles("qwen2_moe")  # the shared expert the declaration does not name splits too
    layer = "model.layers.0.mlp."
    assert moe[layer[:-1]] == "moe"
    assert moe[layer + "experts.gate_up_proj"] == "param_packed_colwise"
    assert moe[layer + "shared_expert.gate_proj"] == "colwise" and moe[layer + "shared_expert.down_proj"] == "rowwise"
    assert moe[layer + "gate.weight"] == moe[layer + "shared_expert_gate.weight"] == "grad_sync"
    oss = _styles("gpt_oss")
    assert oss["model.layers.0.self_attn.sinks"] == "param_heads"
    assert oss["model.layers.0.mlp.experts.down_proj_bias"] == "param_rank0"
    assert oss["model.layers.0.mlp.router.bias"] == "grad_sync"


def test_resolution_of_norms_on_split_heads():
    qwen3 = _styles("qwen3")  # per-head norms replicated, their gradient summed
    assert qwen3["model.layers.0.self_attn.q_norm.weight"] == qwen3["model.layers.0.self_attn.k_norm.weight"] == "grad_sync"
    olmo2 = _styles("olmo2")  # a norm over all heads: its statistic summed over the ranks
    assert olmo2["model.layers.0.self_attn.q_norm"] == "norm_sharded"
    assert olmo2["model.layers.0.self_attn.q_proj"] == "colwise"  # declared gathered: split instead
    assert "model.layers.0.mlp.gate_proj" in olmo2 and olmo2["model.layers.0.mlp"] == "mlp"


def test_kv_projections_are_marked_for_replication():
    styles = _styles("llama", tp=4)  # 2 KV heads over 4 ranks
    assert styles["model.layers.0.self_attn.k_proj"] == styles["model.layers.0.self_attn.v_proj"] == "colwise_kv"
    assert styles["model.layers.0.self_attn.q_proj"] == "colwise"


def test_segment_pieces():
    from tensorpar.sharding.spec import segment_pieces
    assert segment_pieces((8, 4, 4), 1, 2) == ((4, 8), (10, 12), (14, 16))  # [q_1 | k_1 | v_1]
    assert segment_pieces((6,), 2, 3) == ((4, 6),)


def test_an_embedding_subclass_keeps_its_own_forward():
    """Gemma scales its embedding inside its own forward; a plain vocabulary-parallel embedding in
    its place would drop the scale (logits off by 16-73%, seen before this existed)."""
    model = make_tiny_model("gemma")
    ids = torch.tensor([[3, 17, 5, 99]])
    dense = model.model.embed_tokens(ids)
    parallelize(model)
    emb = model.model.embed_tokens
    assert type(emb).__name__ == "VocabParallelGemmaTextScaledWordEmbedding"
    assert torch.equal(emb(ids), dense) and float(emb.embed_scale) != 1.0


def test_undo_restores_every_change_in_place():
    """A failed proof reverts the commit: the model's children keep their order, attributes
    their values, and no hook or substitution is left (checked on a commit reverted at once)."""
    from tensorpar.sharding.commit import commit
    from tensorpar.sharding.declare import declare
    from tensorpar.sharding.place import place
    from tensorpar.sharding.resolve import resolve
    model = make_tiny_model("qwen3")
    before = [(n, type(m).__name__) for n, m in model.named_modules()]
    snap = W._snapshot(model)
    res = resolve(model, declare(model, "auto"), 1)
    undo = commit(model, res, place(model, res, None), None)
    assert any(type(m).__name__ == "ColumnParallelLinear" for m in model.modules())
    undo.revert()
    assert [(n, type(m).__name__) for n, m in model.named_modules()] == before
    assert W.unchanged(model, snap) and not any("_tp_substitutes" in vars(m) for m in model.modules())
