"""Mutants of the import graph's rules and the CLI's light start (issue 21, area graph)."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from mutants import Mutant as M  # noqa: E402

G = "tests/test_import_graph.py"
MUTANTS = [
    M("graph: a command's parser imports its torch job at module level", "cli/verify.py",
      "from tensorpar.cli.progress import Phases, console, reporting_rank",
      "from tensorpar.cli.progress import Phases, console, reporting_rank; from tensorpar.jobs.verify import verify",
      (G, "-k", "starts_without_torch")),
    M("graph: the demo's parser loads numpy for --help", "cli/demo.py",
      "import sys", "import sys; from tensorpar.reference import run_mlp_demo  # noqa: F401",
      (G, "-k", "starts_without_torch")),
    M("graph: an import between tensorpar modules hidden in a function", "distributed/groups.py",
      "return tdist.new_group(ranks=sorted(ranks), backend=shm.BACKEND if backend == \"shm\" else backend)",
      "from tensorpar.distributed import shm; return tdist.new_group(ranks=sorted(ranks), "
      "backend=shm.BACKEND if backend == \"shm\" else backend)",
      (G, "-k", "deferred")),
    M("graph: a module cycle closed inside a function", "distributed/rendezvous.py",
      "sweep_dead(tempfile.gettempdir(), _RDZV_PREFIX, lambda path: shutil.rmtree(path, ignore_errors=True))",
      "from tensorpar.distributed import launcher; sweep_dead(tempfile.gettempdir(), _RDZV_PREFIX, "
      "lambda path: shutil.rmtree(path, ignore_errors=True))",
      (G, "-k", "module")),
    M("graph: a stdlib import deferred into a function", "data/tokens.py",
      "mode = path.stat().st_mode", "import stat; mode = path.stat().st_mode",
      (G, "-k", "deferred")),
    M("graph: a one-letter module alias (C, the collectives here, sharding's commit elsewhere)", "distributed/mappings.py",
      "from tensorpar.distributed import collectives", "from tensorpar.distributed import collectives as C",
      (G, "-k", "aliases")),
    M("graph: F for another module than torch.nn.functional", "reference/advice.py",
      "from __future__ import annotations", "from __future__ import annotations; from tensorpar.reference import costs as F",
      (G, "-k", "aliases")),
    # the former name tensorpar.dist: the same module objects, never a copy; not used inside the package
    M("graph: the former-name finder after the path finders (a second copy of each module)", "__init__.py",
      "sys.meta_path.insert(0, _FormerNames())", "sys.meta_path.append(_FormerNames())",
      (G, "-k", "former_name_dist")),
    M("graph: a module under its former name keeps the alias spec", "__init__.py",
      "module.__spec__ = module.__spec__.loader_state[\"spec\"]  # the module keeps its own spec", "pass",
      (G, "-k", "former_name_dist")),
    M("graph: a module of the package imports the former name", "distributed/launcher.py",
      "from tensorpar.distributed import flight, liveness, preflight, settings",
      "from tensorpar.dist import flight, liveness, preflight, settings",
      (G, "-k", "former_name_of_distributed")),
]
