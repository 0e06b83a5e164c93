"""Mutants of the documentation's promises (issue 21, area docs): one-line changes to tensorpar
that leave the README and docs/ saying something untrue, each caught by tests/test_docs.py."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from mutants import Mutant as M  # noqa: E402

T = "tests/test_docs.py"
MUTANTS = [
    M("docs: a name the README imports no longer exported (tensorpar.models.load_sharded)", "models/__init__.py",
      '"load_sharded": "tensorpar.models.checkpoint", "LoadReport": "tensorpar.models.checkpoint",',
      '"LoadReport": "tensorpar.models.checkpoint",',
      (T, "-m", "not multirank", "-k", "resolves")),
    M("docs: a train option renamed and the CLI reference not following", "cli/train.py",
      'p.add_argument("--save-every", type=int, default=None, metavar="K",',
      'p.add_argument("--checkpoint-every", dest="save_every", type=int, default=None, metavar="K",',
      (T, "-m", "not multirank", "-k", "cli_reference")),
    M("docs: an environment variable read under a name the docs do not give", "distributed/settings.py",
      'return _choice("TENSORPAR_TRACEBACK", ("0", "1"), "0") == "1"',
      'return _choice("TENSORPAR_TRACE", ("0", "1"), "0") == "1"',
      (T, "-m", "not multirank", "-k", "environment_variable")),
    M("docs: run's proof line worded otherwise than the README shows", "cli/run.py",
      'con.print(f"\\n[bold]Proof[/]: largest difference from the unsplit model {r.max_abs_diff:.2e} "',
      'con.print(f"\\n[bold]Proof[/]: largest deviation from the unsplit model {r.max_abs_diff:.2e} "',
      (T, "-k", "shown_output_is_the_real")),
    M("docs: load_sharded returns the model alone, not the (model, report) pair the README unpacks",
      "models/checkpoint.py",
      "return model, LoadReport(str(path), rep.family, rep.tp_size, rep.tp_rank, total, shard,",
      "return model; LoadReport(str(path), rep.family, rep.tp_size, rep.tp_rank, total, shard,",
      (T, "-k", "python_block")),
]
