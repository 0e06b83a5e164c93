"""tensorpar: tensor parallelism that states its costs, measures them, and proves equivalence.

The top level is the seed API, in numpy over simulated devices (``tensorpar.reference``).
Every name is loaded on first use, so ``import tensorpar`` imports neither torch nor numpy:
``tensorpar.planner`` stays stdlib-only and the torch runtime (``tensorpar.dist``,
``tensorpar.nn``, ``tensorpar.models``, ``tensorpar.parallelize``) loads only when asked for.
"""
import importlib

__version__ = "0.1.0"

_LAZY = {
    "column_parallel": "tensorpar.reference",
    "row_parallel": "tensorpar.reference",
    "mlp_tensor_parallel": "tensorpar.reference",
    "shard_bytes": "tensorpar.reference",
    "ring_allreduce_bytes": "tensorpar.reference",
    "parallelize": "tensorpar.sharding.pipeline",
    "audit": "tensorpar.sharding.audit",
    "save": "tensorpar.models.saving",
    "load": "tensorpar.models.saving",
    "export": "tensorpar.models.saving",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tensorpar' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
