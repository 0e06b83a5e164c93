"""tensorpar: tensor parallelism that states its costs, measures them, and proves equivalence.

The top level is the seed API, in numpy over simulated devices (``tensorpar.reference``).
Every name is loaded on first use, so ``import tensorpar`` imports neither torch nor numpy:
``tensorpar.planner`` stays stdlib-only and the torch runtime (``tensorpar.distributed``,
``tensorpar.nn``, ``tensorpar.models``, ``tensorpar.parallelize``) loads only when asked for.

``tensorpar.dist`` is ``tensorpar.distributed``'s former name (a folder named ``dist`` is what
Python's standard ``.gitignore`` leaves out as build output): ``from tensorpar import dist`` and
``import tensorpar.dist.launcher`` keep working and give the very module objects of
``tensorpar.distributed``, not copies (:class:`_FormerNames`).
"""
import importlib
import importlib.abc
import importlib.machinery
import sys

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

# A package's former name -> its name: what code written before the rename imports.
_FORMER_NAMES = {"tensorpar.dist": "tensorpar.distributed"}


class _FormerNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module by its former name as the module of its current name: one object under
    both names (``sys.modules`` holds it twice), so classes, ``isinstance``, monkeypatches and a
    module's state are shared, and a pickle naming either loads. The current module is imported
    only when the former name is, so ``import tensorpar`` still loads no torch."""

    def find_spec(self, name, path=None, target=None):
        former = next((f for f in _FORMER_NAMES if name == f or name.startswith(f + ".")), None)
        if former is None:
            return None
        current = _FORMER_NAMES[former] + name[len(former):]
        return importlib.machinery.ModuleSpec(name, self, loader_state={"current": current})

    def create_module(self, spec):
        module = importlib.import_module(spec.loader_state["current"])
        spec.loader_state["spec"] = module.__spec__  # the import system sets __spec__ to ours next
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state["spec"]  # the module keeps its own spec


# First on the path: a finder after it would load the file again under the former name, a copy.
if not any(isinstance(f, _FormerNames) for f in sys.meta_path):
    sys.meta_path.insert(0, _FormerNames())


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if f"{__name__}.{name}" in _FORMER_NAMES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'tensorpar' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
