"""tensorpar.models: running sharded Hugging Face models (checkpoints, generation, training).

Plans and their application live in :mod:`tensorpar.sharding` (``tensorpar.parallelize``);
this package runs what they produce. Names load on first use (this package imports neither
transformers nor safetensors until asked):

- checkpoints: ``load_sharded`` (each rank reads only its slices of a safetensors checkpoint)
- inference: ``generate`` (greedy, per-rank KV cache)
- training: ``train_step``, ``causal_lm_loss``, ``clip_grad_norm_``
- test models: ``make_tiny_config``, ``make_tiny_model``, ``make_tiny_checkpoint`` (any architecture)
- all-MiniLM-L6-v2: ``minilm_path``, ``load_minilm``, ``sentence_embeddings``
- re-exported from :mod:`tensorpar.architecture` and :mod:`tensorpar.sharding`: ``ARCHS``,
  ``model_dims``, ``check_feasibility``, ``FeasibilityReport``, ``ParallelizeReport``
"""
import importlib

_LAZY = {
    "ARCHS": "tensorpar.architecture.registry", "model_dims": "tensorpar.sharding.sizes",
    "check_feasibility": "tensorpar.sharding.check",
    "FeasibilityReport": "tensorpar.architecture.tp_rules",
    "ParallelizeReport": "tensorpar.sharding.parallelize_report",
    "load_sharded": "tensorpar.models.checkpoint", "LoadReport": "tensorpar.models.checkpoint",
    "generate": "tensorpar.models.generation",
    "train_step": "tensorpar.models.training", "causal_lm_loss": "tensorpar.models.training",
    "clip_grad_norm_": "tensorpar.models.training",
    "make_tiny_config": "tensorpar.models.tiny", "make_tiny_model": "tensorpar.models.tiny",
    "make_tiny_checkpoint": "tensorpar.models.tiny",
    "minilm_path": "tensorpar.models.minilm", "load_minilm": "tensorpar.models.minilm",
    "sentence_embeddings": "tensorpar.models.minilm",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tensorpar.models' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
