"""A model's own tensor-parallel declaration (transformers' ``tp_plan``), in tensorpar's styles.

transformers 5 ships a plan with most architectures (``config.base_model_tp_plan`` and the
head classes' ``_tp_plan``, merged into ``model.tp_plan``): module or parameter name patterns
with styles that its DTensor machinery applies. Each style maps to one of tensorpar's
(:data:`TRANSLATION`); the styles whose semantics tensorpar gets from the plan's structure
rather than from the entry (a replicated norm's gradient all-reduce, the experts region) are
translated there too, so that nothing of the declaration is dropped silently: a style with no
translation leaves its block whole, with the reason in ``model.tp_report``.
"""
from __future__ import annotations

# transformers style -> (tensorpar style for a module, tensorpar style for a parameter)
TRANSLATION = {
    "colwise": ("colwise", "param_colwise"),
    "colwise_rep": ("colwise_gather", None),
    "colwise_gather_output": ("colwise_gather", None),
    "rowwise": ("rowwise", "param_rowwise"),
    "rowwise_rep": ("rowwise_split", None),
    "rowwise_split_input": ("rowwise_split", None),
    "packed_colwise": ("fused_colwise", "param_packed_colwise"),
    "packed_rowwise": (None, "param_packed_rowwise"),
    "embedding_rowwise": ("vocab", None),
    "replicated_with_grad_allreduce": ("grad_sync", "grad_sync"),
    "moe_tp_experts": ("experts", None),  # marks the experts module; its parent becomes a 'moe' region
    "mla_kv_a_proj": ("replicate", None),  # inside the attention region: its gradient is all-reduced
    "local_params": ("replicate", None),  # tensorpar's parameter styles already run locally
    "replicate": ("replicate", "replicate"),
}
# Declared styles with no exact translation (yet): the block holding them stays whole.
UNTRANSLATED = {
    "moe_identity_expert": "identity experts return the same value on every rank inside a "
                           "partial-sum region (transformers divides them by tp; not exact in general)",
    "all_reduce": "a module output all-reduced with no declared partner",
    "embedding_colwise": "an embedding split along the hidden size",
    "sequence_parallel": "sequence parallelism of Hugging Face models",
}


def translate(style: str, is_param: bool) -> tuple[str | None, str | None]:
    """``(tensorpar style or None, why not)`` for one declared entry."""
    if style in UNTRANSLATED:
        return None, f"declared style {style!r}: {UNTRANSLATED[style]}"
    pair = TRANSLATION.get(style)
    if pair is None:
        return None, f"declared style {style!r} is unknown to tensorpar"
    ours = pair[1] if is_param else pair[0]
    if ours is None:
        kind = "parameter" if is_param else "module"
        return None, f"declared style {style!r} on a {kind} has no tensorpar translation"
    return ours, None
