"""The architecture matrix, run on every rank of one 4-rank launch (tests/test_models_matrix.py).

Each architecture is built tiny from its transformers config class (float64, one seed on every
rank), parallelized with ``plan="auto"`` and compared with its unsplit copy on the same token ids:

- the logits, forward (decoders with cross-attention also given random encoder states);
- every parameter's gradient of ``<logits, R>`` (R random): a shard against the same slice of the
  dense gradient (``p.tp_spec``), a replicated tensor whole; tied parameters under each name;
- greedy generation with the KV cache: the logits of every decoding step, fed the same tokens;
- each rank's share of the decoder-layer parameters.

The comparison is the test's own: it does not use tensorpar's proof (``sharding.prove``), and the
tolerance depends on the precision the dense model computes in, detected here: a float64 model
whose router runs its softmax in float32 is exact to float32's rounding only.

tp 2 runs on two sub-groups at once ({0, 1} and {2, 3}, the architectures alternating), tp 4 on
all four ranks.
"""
from __future__ import annotations

import copy
import re
import time
import traceback
import warnings

import torch

# Causal-LM architectures of transformers 5.24 whose configuration builds a tiny model on CPU,
# minus composites with vision or audio towers (git, got_ocr2, moshi, moss_transcribe_diarize,
# phi4_multimodal) and those whose tiny model does not build at all (see tensorpar.models.tiny).
ARCHS = (
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "axk2", "bailing_hybrid",
    "bamba", "bart", "beam", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "biogpt",
    "bitnet", "blenderbot", "blenderbot-small", "bloom", "camembert", "codegen", "cohere", "cohere2",
    "cohere2_moe", "cpmant", "ctrl", "cwm", "data2vec-text", "deepseek_v2", "deepseek_v3",
    "deepseek_v32", "deepseek_v4", "diffllama", "doge", "dory", "dots1", "electra", "ernie",
    "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "falcon", "falcon_mamba",
    "flex_olmo", "flint", "gemma", "gemma2", "gemma3_text", "gemma4_text", "gemma4_unified_text",
    "glm", "glm4", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt-sw3", "gpt2", "gpt_bigcode",
    "gpt_neox", "gpt_neox_japanese", "gpt_oss", "gptj", "granite", "granite_swa", "granitemoe",
    "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "helium", "hrm_text", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "hy_v3", "hy_v4", "hyperclovax", "inkling_text", "internlm3", "iquestcoder",
    "jais2", "jamba", "jetmoe", "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2", "lfm3",
    "llama", "llama4_text", "mamba", "marian", "mbart", "megatron-bert", "mellum", "mimo_v2_flash",
    "minicpm3", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mistral",
    "mixtral", "modernbert-decoder", "mpt", "mvp", "nanochat", "nemotron", "olmo", "olmo2", "olmo3",
    "olmo_hybrid", "olmoe", "openai-gpt", "opt", "pegasus", "persimmon", "phi", "phi3", "phimoe",
    "plbart", "prophetnet", "qwen2", "qwen2_moe", "qwen3", "qwen3_5_moe_text", "qwen3_5_text",
    "qwen3_moe", "qwen3_next", "qwen4_exp_text", "recurrent_gemma", "rembert", "roberta",
    "roberta-prelayernorm", "roc_bert", "roformer", "rwkv", "sarvam_mla", "sarvam_moe", "seed_oss",
    "smollm3", "solar_open", "stablelm", "starcoder2", "trocr", "vaultgemma", "whisper", "xlm",
    "xlm-roberta", "xlm-roberta-xl", "xlnet", "xlstm", "youtu",
)
# `make test` runs these (a third of the matrix, ~70 s): every plan source (declared, tensorpar's,
# discovered) and every layer kind — fused qkv / gate_up, parallel blocks, ALiBi, learned
# positions, sliding and sink layers, MoE (fused 3-D experts, shared experts, moe_experts
# regions), MLA, per-head norms, state-space and linear-attention mixers, encoder-decoders with
# cross-attention, scaled embeddings. CI (`.ci/run`) and `make coverage` run all of ARCHS
# (TENSORPAR_MATRIX=all).
QUICK = (
    "afmoe", "axk1", "bailing_hybrid", "bart", "bert", "bloom", "codegen", "cohere", "deepseek_v2",
    "deepseek_v3", "diffllama", "doge", "dory", "ernie4_5_moe", "falcon", "gemma", "gemma2", "gemma3_text",
    "gemma4_text", "glm4_moe", "gpt2", "gpt_bigcode", "gpt_neox", "gpt_oss", "gptj", "granitemoehybrid",
    "jamba", "kimi_linear", "lfm2", "llama", "llama4_text", "mamba", "mimo_v2_flash", "minimax", "mixtral",
    "mpt", "olmo2", "olmoe", "opt", "persimmon", "phi", "phi3", "qwen3", "qwen3_moe", "qwen3_next",
    "recurrent_gemma", "stablelm", "trocr", "whisper", "xlnet",
)
assert set(QUICK) <= set(ARCHS)
BATCH, SEQ, NEW_TOKENS = 2, 12, 3
_LAYER = re.compile(r"\.(?:layers|layer|h|blocks|block)\.\d+\.")


class _Dtypes(torch.overrides.TorchFunctionMode):
    """The floating dtypes of the dense model's results that gradients flow through (the test's
    own detection; float32 on constants, such as rotary cos/sin, is the same on both sides)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                self.seen.add(t.dtype)
        return out


def _logits(model, ids, encoder=None):
    extra = {} if encoder is None else {"encoder_hidden_states": encoder}
    return model(input_ids=ids, use_cache=False, **extra).logits


def _encoder_states(model, batch):
    """Random encoder states for a decoder with cross-attention, so that the comparison runs it."""
    import inspect
    cross = any(n.rpartition(".")[2] in ("encoder_attn", "crossattention", "cross_attn") for n, _ in model.named_modules())
    if "encoder_hidden_states" not in inspect.signature(model.forward).parameters or not cross:
        return None
    config = model.config
    width = getattr(config, "d_model", None) or config.hidden_size
    return torch.randn((batch, 7, width), generator=torch.Generator().manual_seed(13), dtype=torch.float64)


def _rel(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _grad_error(split, dense) -> tuple[float, str | None]:
    """Worst |split grad - slice of dense grad| over every parameter, relative to the largest
    dense gradient of the model (a parameter whose exact gradient vanishes is judged on it)."""
    dense_params = dict(dense.named_parameters(remove_duplicate=False))
    scale = max(p.grad.abs().max().item() for p in dense_params.values() if p.grad is not None)
    worst, where = 0.0, None
    for name, p in split.named_parameters(remove_duplicate=False):
        ref = dense_params[p.tp_spec.key].grad
        if ref is None:
            err = 0.0 if p.grad is None or not p.grad.abs().max() else float("inf")
        else:
            mine = p.tp_spec.apply(ref)
            err = float("inf") if p.grad is None or p.grad.shape != mine.shape else (
                (p.grad - mine).abs().max().item() / scale)
        if err > worst:
            worst, where = err, name
    return worst, where


def _norm_error(split, dense) -> float:
    """tensorpar's global gradient norm (each parameter once over the ranks) against torch's on the
    dense model (max_norm too large to clip: only the norm is compared)."""
    from tensorpar.models.training import clip_grad_norm_
    mine = clip_grad_norm_(split, 1e30)
    want = torch.nn.utils.clip_grad_norm_(dense.parameters(), 1e30)
    return abs(mine.item() - want.item()) / want.item()


def _layer_share(split, dense) -> float:
    def count(m):
        return sum(p.numel() for n, p in m.named_parameters() if _LAYER.search(f".{n}"))
    return count(split) / max(1, count(dense))


def _generation_error(split, dense, ids) -> float | None:
    """Worst relative difference of the logits over every greedy decoding step (cache on)."""
    from tensorpar.models.generation import generate
    if not getattr(dense.config, "is_decoder", True) and dense.config.model_type in ("bert",):
        return None
    try:
        with torch.no_grad():
            d_ids, d_steps = generate(dense, ids, NEW_TOKENS, return_logits=True, engine="hf")  # the model's own forward
    except Exception:  # noqa: BLE001 - a model whose dense copy cannot decode with a cache
        return None
    with torch.no_grad():
        s_ids, s_steps = generate(split, ids, NEW_TOKENS, return_logits=True)
    return max(_rel(s, d) for s, d in zip(s_steps, d_steps)) if torch.equal(s_ids, d_ids) else float("inf")


def check(arch: str, group) -> dict:
    """Everything the matrix asserts about one architecture on this rank."""
    from transformers.utils import logging as hf_logging

    from tensorpar import parallelize
    from tensorpar.models.tiny import make_tiny_model
    hf_logging.set_verbosity_error()
    t0 = time.time()
    dense = make_tiny_model(arch)
    split = copy.deepcopy(dense)
    vocab = dense.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))
    try:
        parallelize(split, tp_group=group)
    except ValueError as exc:
        return {"status": "refused", "why": str(exc)}
    report = split.tp_report
    # what the planner and the checkpoint loader build from, before any proof runs
    unproved = parallelize(copy.deepcopy(dense), tp_group=group, prove=False).tp_report.styles
    cot = None
    out, enc_grads = {}, {}
    encoder = _encoder_states(dense, BATCH)
    with _Dtypes() as dtypes:
        for name, model in (("dense", dense), ("split", split)):
            enc = None if encoder is None else encoder.clone().requires_grad_(True)
            logits = _logits(model, ids, enc)
            cot = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5),
                              dtype=logits.dtype) if cot is None else cot
            (logits * cot).sum().backward()
            out[name] = logits.detach()
            enc_grads[name] = None if enc is None else enc.grad
            if name == "dense":
                precision = min(dtypes.seen, key=lambda d: torch.finfo(d).bits)
    grad, grad_where = _grad_error(split, dense)
    if encoder is not None:  # the encoder states' gradient: through the cross-attention's own input copy
        grad = max(grad, _rel(enc_grads["split"], enc_grads["dense"]))
    norm = _norm_error(split, dense)
    split.zero_grad(set_to_none=True)
    dense.zero_grad(set_to_none=True)
    return {"status": "ran", "logits": _rel(out["split"], out["dense"]), "grad": grad, "grad_where": grad_where,
            "grad_norm": norm,
            "generation": _generation_error(split, dense, ids[:1, :6]),
            "float64": precision == torch.float64, "share": _layer_share(split, dense),
            "source": report.source, "whole": dict(report.whole), "tp": report.tp_size,
            "reported": report.status, "layers_replicated": report.layers_replicated[:4],
            "fallbacks": [n for n in report.notes if "reduced where they are made" in n or "not all-reduced" in n],
            "proof_changed": sorted(set(report.styles.items()) ^ set(unproved.items()))[:6],
            "seconds": time.time() - t0}


def matrix_worker(archs, tp_sizes) -> dict:
    """``{(arch, tp): result}`` for the cases this rank took part in."""
    from tensorpar import distributed as dist
    torch.set_num_threads(1)
    # exactness is checked numerically here; a mismatched schedule still stops the launch through
    # the flight recorder, without a signature exchange before each of the proofs' collectives
    dist.check_collectives(False)
    warnings.filterwarnings("ignore")
    return each_case(archs, tp_sizes, _guarded_check)


def _guarded_check(arch, group) -> dict:
    try:
        return check(arch, group)
    except Exception as exc:  # noqa: BLE001 - reported per architecture, the launch goes on
        if "gloo" in str(exc) or "pair closure" in str(exc):
            raise  # the group is broken: every later case would fail with it; stop here
        return {"status": "error", "why": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}


def each_case(archs, tp_sizes, fn) -> dict:
    """``{(arch, tp): fn(arch, group)}`` for the cases this rank takes part in: on 4 ranks, tp 2 on
    two sub-groups at once ({0, 1} and {2, 3}, the architectures alternating), tp 4 on all four."""
    from tensorpar import distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else [None]
    results = {}
    for tp in tp_sizes:
        if tp == 2 and world == 4:
            group, mine = pairs[rank // 2], archs[rank // 2::2]
        else:
            group, mine = None, archs
        for arch in mine:
            results[(arch, tp)] = fn(arch, group)
    return results
