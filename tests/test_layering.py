"""The dependency rules of DESIGN.md, enforced.

reference/ is numpy-only, architecture/ stdlib-only and planner/ stdlib-only besides the
architecture facts; reference imports neither, and none imports torch.
Only distributed/ calls torch.distributed. `import tensorpar` must not load torch.
"""
import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "tensorpar"
STDLIB = set(sys.stdlib_module_names)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            names.add("." * node.level + (node.module or ""))
    return names


def _files(sub: str):
    files = sorted((PKG / sub).rglob("*.py"))
    assert files, f"no modules under tensorpar/{sub}"
    return files


@pytest.mark.parametrize("sub, allowed", [
    ("reference", {"numpy", "tensorpar.reference"}),
    ("architecture", {"tensorpar.architecture"}),
    ("planner", {"tensorpar.planner", "tensorpar.architecture"}),
])
def test_standalone_packages_import_only_what_they_may(sub, allowed):
    for path in _files(sub):
        for name in _imports(path):
            if name.startswith("."):
                assert not name.startswith(".."), f"{path}: relative import {name} leaves {sub}/"
                continue
            top = name.split(".")[0]
            ok = top in STDLIB or any(name == a or name.startswith(a + ".") for a in allowed)
            assert ok, f"{path.relative_to(PKG.parent)} imports {name}; {sub}/ may import only {sorted(allowed)} and the stdlib"


# The baseline benchmark *is* PyTorch's torch.distributed.tensor.parallel; nothing else may.
_TORCH_DIST_ALLOWED = {PKG / "bench" / "baselines.py"}


def test_only_dist_calls_torch_distributed():
    for path in PKG.rglob("*.py"):
        if "distributed" in path.relative_to(PKG).parts[:1] or path in _TORCH_DIST_ALLOWED:
            continue
        src = path.read_text()
        for name in _imports(path):
            assert not name.startswith("torch.distributed"), f"{path} imports {name}; only tensorpar/distributed may"
        assert "torch.distributed" not in src, (
            f"{path} mentions torch.distributed; route collectives through tensorpar.distributed")


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)


def test_import_tensorpar_does_not_import_torch():
    r = _fresh("""
        import sys, tensorpar
        tensorpar.column_parallel
        assert 'torch' not in sys.modules, 'import tensorpar loaded torch'
    """)
    assert r.returncode == 0, r.stderr


def test_planner_imports_without_numpy_or_torch():
    r = _fresh("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('numpy', 'torch'):
                    raise ImportError('blocked ' + name)
        sys.meta_path.insert(0, Block())
        import tensorpar.planner
    """)
    assert r.returncode == 0, r.stderr


def test_top_level_lazy_names_resolve():
    import tensorpar

    for name in tensorpar.__all__:
        assert getattr(tensorpar, name) is not None, name
    assert callable(tensorpar.parallelize) and tensorpar.parallelize.__module__ == "tensorpar.sharding.pipeline"


def test_lazy_function_names_are_not_shadowed_by_submodules():
    # A submodule named like a lazily exported function would replace it once imported.
    import importlib
    import pkgutil

    import tensorpar
    import tensorpar.models as models

    for pkg in (tensorpar, models):
        subs = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
        clash = sorted(subs & set(pkg._LAZY))
        assert not clash, f"{pkg.__name__}: submodules {clash} shadow functions of the same name"
    importlib.import_module("tensorpar.models.generation")
    assert callable(models.generate)


def test_the_architecture_registry_is_plain_data():
    """Architecture facts live in one registry every consumer reads; it loads without torch."""
    r = _fresh("""
        import sys
        import tensorpar.architecture.registry as registry
        assert 'torch' not in sys.modules, 'the registry loaded torch'
        assert registry.ARCHS['gpt2'].plan and 'phi3' in registry.ARCHS
    """)
    assert r.returncode == 0, r.stderr
