"""Will a layout run: divisibility of every split dimension, and memory against capacity.

Each problem is either a *reason* (the layout cannot run as asked) or a *fix* the planner applies
and prices (padding, KV-head replication). Megatron-LM requires heads, ffn and vocabulary to
divide by tp (Shoeybi et al. 2019, Sec. 3) and pads the vocabulary (``make_vocab_size_divisible_by``);
KV-head replication when tp exceeds the kv heads is what vLLM and TensorRT-LLM do for GQA.
"""
from __future__ import annotations

from .flops import forward_flops_per_token, layer_forward_flops_per_token, lm_head_forward_flops_per_token
from .layout import Layout
from .models import ModelSpec, divisors
from .params import padded, valid_tp_sizes


def clean_tp_sizes(model: ModelSpec) -> list[int]:
    """tp sizes that need no fix at all: heads, kv heads, ffn and vocabulary all divide."""
    return [t for t in valid_tp_sizes(model)
            if model.kv_heads % t == 0 and model.ffn % t == 0 and model.vocab % t == 0]


def divisibility(model: ModelSpec, layout: Layout) -> tuple[list[str], list[dict]]:
    """Reasons the split cannot run, and the fixes applied (with their cost). When tp cannot split
    the heads no fix is listed: padding ffn or the vocabulary would not make it run."""
    t, reasons, fixes = layout.tp, [], []
    valid = ", ".join(map(str, valid_tp_sizes(model)))
    if model.heads % t:
        reasons.append(f"tp ({t}) must divide heads ({model.heads}); valid tp sizes: {valid}")
    elif model.kv_heads % t and t % model.kv_heads:
        reasons.append(f"tp ({t}) must divide kv_heads ({model.kv_heads}) or be a multiple of it; "
                       f"valid tp sizes: {valid}")
    elif model.kv_heads % t:
        fixes.append(_kv_replication_fix(model, layout))
    if not reasons:  # padding only helps a split the heads allow
        if model.ffn % t:
            fixes.append(_ffn_padding_fix(model, layout))
        if model.vocab % t:
            fixes.append(_vocab_padding_fix(model, layout))
    if layout.sequence_parallel and model.seq % t:
        reasons.append(f"sequence parallelism splits seq ({model.seq}) over tp ({t}); "
                       f"valid seq: multiples of {t}")
    if model.layers % layout.pp:
        reasons.append(f"pp ({layout.pp}) must divide layers ({model.layers}); valid pp sizes: "
                       f"{', '.join(map(str, divisors(model.layers)))}")
    return reasons, fixes


def _kv_replication_fix(model, layout) -> dict:
    t, g, d, h = layout.tp, model.kv_heads, model.head_dim, model.hidden
    copies = t // g
    extra_params = model.layers * 2 * h * d * (t - g)  # K and V columns of (t - g) extra kv heads
    return {"dimension": "kv_heads", "fix": f"replicate each of the {g} kv heads on {copies} ranks",
            "extra_params": extra_params, "extra_weight_bytes_per_replica": extra_params * layout.bytes_per_elem,
            "kv_cache_factor": copies, "applied_by_tensorpar_runtime": True,
            "cost": f"K/V weights and the KV cache of one replica grow {copies}x; in training the replicas' "
                    "k/v weight gradients are all-reduced once per layer (none in inference)"}


def _ffn_padding_fix(model, layout) -> dict:
    t, f, h = layout.tp, model.ffn, model.hidden
    pad = padded(f, t) - f
    extra = model.layers * (model.mlp_matrices * h * pad + (pad if model.biases else 0))
    layer = layer_forward_flops_per_token(model, model.seq)
    flops_frac = 2 * model.mlp_matrices * h * pad / sum(layer.values())  # per token and layer
    return {"dimension": "ffn", "fix": f"pad ffn {f} -> {f + pad} (zero columns/rows)",
            "extra_params": extra, "extra_weight_bytes": extra * layout.bytes_per_elem,
            "extra_flops_fraction": flops_frac, "applied_by_tensorpar_runtime": False,
            "cost": f"{extra:,} zero parameters, {flops_frac:.2%} more layer FLOPs (tensorpar's ParallelMLP "
                    "does not pad: there tp must divide ffn)"}


def _vocab_padding_fix(model, layout) -> dict:
    t, v, h = layout.tp, model.vocab, model.hidden
    pad = padded(v, t) - v
    matrices = 1 if model.tied_embeddings else 2
    extra = matrices * pad * h
    flops_frac = pad / v * lm_head_forward_flops_per_token(model) / forward_flops_per_token(model, model.seq)
    return {"dimension": "vocab", "fix": f"pad vocab {v} -> {v + pad} (masked zero rows)",
            "extra_params": extra, "extra_weight_bytes": extra * layout.bytes_per_elem,
            "extra_flops_fraction": flops_frac, "applied_by_tensorpar_runtime": True,
            "cost": f"{extra:,} zero parameters, {flops_frac:.3%} more FLOPs (LM head)"}


def memory_reasons(memory: dict, capacity: float, layout: Layout) -> list[str]:
    """A reason when the busiest device needs more than its capacity, with what would help."""
    total = memory["total"]
    if total <= capacity:
        return []
    helps = []
    if layout.workload == "train" and layout.recompute != "full":
        helps.append("--recompute full")
    if layout.workload == "train" and layout.zero_stage < 3 and layout.dp > 1:
        helps.append(f"--zero-stage {layout.zero_stage + 1}")
    helps += ["a larger tp or pp", "a device with more memory"]
    return [f"memory per device {total / 1e9:.2f} GB exceeds capacity {capacity / 1e9:.2f} GB "
            f"(weights {memory['weights'] / 1e9:.2f}, gradients {memory['gradients'] / 1e9:.2f}, "
            f"optimizer {memory['optimizer'] / 1e9:.2f}, activations {memory['activations'] / 1e9:.2f}, "
            f"kv cache {memory['kv_cache'] / 1e9:.2f} GB); try: {', '.join(helps)}"]


def placement_warnings(layout: Layout, devices_per_node: int) -> list[str]:
    """Layouts that run but put latency-critical traffic on slow links."""
    warnings = []
    if layout.tp > devices_per_node:
        warnings.append(f"tp ({layout.tp}) exceeds devices per node ({devices_per_node}): every layer's "
                        "collectives cross the inter-node network; keep tp within a node")
    elif devices_per_node % layout.tp:
        warnings.append(f"tp ({layout.tp}) does not divide devices per node ({devices_per_node}): "
                        "some tp groups straddle two nodes")
    return warnings
