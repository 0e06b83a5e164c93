"""Will a layout run: the runtime's tp rule, pipeline and sequence divisibility, memory against
capacity; and the fixes the runtime applies, with their cost.

The tp sizes are the runtime's (``tensorpar.architecture.tp_rules``, read by the source: the
templates and the meta-device split alike): query heads and every split width (the MLP's
included: the runtime does not pad it) divide tp, KV heads divide it or are replicated
(each on ``tp / n_kv`` ranks, as vLLM and TensorRT-LLM do for GQA), the vocabulary is padded
(Megatron-LM's ``make_vocab_size_divisible_by``). Each problem is a *reason* (the layout cannot
run as asked) or a *fix* the runtime applies, priced from the split model.
"""
from __future__ import annotations

from tensorpar.architecture.split_model import SplitModel

from .layout import Layout
from .source import source_of


def valid_tp_sizes(model) -> list[int]:
    """The tp sizes the runtime splits ``model`` (a ModelSpec or a source) at."""
    return list(source_of(model).valid_tp_sizes())


def clean_tp_sizes(model) -> list[int]:
    """tp sizes that need no fix at all: the KV heads and the vocabulary divide too."""
    return [t for t in valid_tp_sizes(model) if model.kv_heads % t == 0 and model.vocab % t == 0]


def _excess(p) -> int:
    """Elements the ranks hold beyond the dense tensor (padding, replicated rows), for a split one."""
    return sum(r.numel for r in p.ranks) - p.numel if p.ranks[0].pieces is not None else 0


def fixes(split: SplitModel, bytes_per_elem: int, forward_flops_per_token: float) -> list[dict]:
    """KV-head replication and vocabulary padding, as the runtime applies them at ``split.tp``."""
    out, e, t, g = [], bytes_per_elem, split.tp, split.kv_heads
    kv = sum(_excess(p) for p in split.params if p.style not in ("vocab", "vocab_head"))
    if g and t > g and kv:
        copies = t // g
        out.append({"dimension": "kv_heads", "fix": f"replicate each of the {g} kv heads on {copies} ranks",
                    "extra_params": kv, "extra_weight_bytes_per_replica": kv * e, "kv_cache_factor": copies,
                    "applied_by_tensorpar_runtime": True,
                    "cost": f"K/V weights and the KV cache of one replica grow {copies}x; in training the replicas' "
                            "k/v weight gradients are all-reduced once per layer (none in inference)"})
    vocab = sum(_excess(p) for p in split.params if p.style in ("vocab", "vocab_head"))
    if vocab:
        per = -(-split.vocab // t)
        head = [m for m in split.matmuls if m.head]
        extra_flops = sum(sum(m.ranks) - m.flops for m in head)
        frac = extra_flops / forward_flops_per_token if forward_flops_per_token else 0.0
        out.append({"dimension": "vocab", "fix": f"pad vocab {split.vocab} -> {per * t} (masked zero rows)",
                    "extra_params": vocab, "extra_weight_bytes": vocab * e, "extra_flops_fraction": frac,
                    "applied_by_tensorpar_runtime": True,
                    "cost": f"{vocab:,} zero parameters, {frac:.3%} more FLOPs (LM head)"})
    return out


def sequence_reasons(seq: int, layout: Layout) -> list[str]:
    if layout.sequence_parallel and seq % layout.tp:
        return [f"sequence parallelism splits seq ({seq}) over tp ({layout.tp}); valid seq: multiples of {layout.tp}"]
    return []


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
