"""Mutants of the one planner (issue 21, area planner): the templates against the meta-device
producer, a config's one path through the CLI, the meta source, the runtime's tp rule."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from mutants import Mutant as M  # noqa: E402

TEMPLATES = ("tests/test_planner_templates.py",)
CLI = "tests/test_planner_cli.py"
MUTANTS = [
    M("[planner] template: a region's backward all-reduce carries twice the hidden size", "architecture/templates.py",
      'return CollectiveSite(module, "all_reduce", "backward", per_token=h, when="train", style=style,',
      'return CollectiveSite(module, "all_reduce", "backward", per_token=2 * h, when="train", style=style,',
      TEMPLATES),
    M("[planner] template: replicated KV rows' gradient sync counts K rows only", "architecture/templates.py",
      "rows = 2 * s.head_dim", "rows = s.head_dim", TEMPLATES),
    M("[planner] template: the tp rule checks the heads where the MLP width must divide", "architecture/templates.py",
      "return tp_rules.Dims(self.heads, self.kv_heads, self.head_dim, self.ffn, self.vocab, self.hidden)",
      "return tp_rules.Dims(self.heads, self.kv_heads, self.head_dim, self.heads, self.vocab, self.hidden)",
      ("tests/test_planner_search.py", "-k", "runtimes_the_mlp_width")),
    M("[planner] cli: shape options over a config silently ignored", "cli/plan.py",
      "if shapes:", "if False:", (CLI, "-k", "refused_in_one_line")),
    M("[planner] cli: a config planned as a preset unless --inventory", "cli/plan.py",
      "if path is None:", "if path is None or not args.inventory:",
      ("tests/test_planner_coverage.py", "-k", "inventory_is_the_same")),
    M("[planner] meta source: the model built without its output head", "sharding/inventory.py",
      "self._dense = _meta_model(self.config, head=True)", "self._dense = _meta_model(self.config, head=False)",
      ("tests/test_planner_inventory.py", "-k", "plan_of_a_config")),
    M("[planner] meta source: --seq named but not planned", "sharding/inventory.py",
      'return seq, "--seq"', 'return 2048, "--seq"', (CLI, "-k", "labels_what_it_counts")),
    M("[planner] meta source: a model that cannot be built raises its own error", "sharding/inventory.py",
      "except _BUILD_ERRORS as exc:", "except ZeroDivisionError as exc:", (CLI, "-k", "refused_in_one_line")),
    M("[planner] plan: selective recomputation keeps the attention scores", "architecture/split_model.py",
      'if recompute == "none":', "if True:", (CLI, "-k", "every_option")),
    M("[planner] plan: full recomputation keeps every activation", "planner/split_memory.py",
      'if recompute == "full":', "if False:", (CLI, "-k", "every_option")),
    M("[planner] meta source: a model without attention heads has hidden size 0", "sharding/inventory.py",
      'hidden=_width(text, dims, "hidden"), vocab=_width(text, dims, "vocab"),',
      'hidden=dims.hidden if dims else 0, vocab=_width(text, dims, "vocab"),',
      ("tests/test_planner_coverage.py", "-k", "boundary_activations")),
    M("[planner] meta source: a config's {'__float__': 'Infinity'} read as a dict", "sharding/inventory.py",
      "d = PretrainedConfig._decode_special_floats(d)", "pass",
      ("tests/test_planner_coverage.py", "-k", "infinity")),
    M("[planner] meta source: a model without attention heads has vocabulary 0", "sharding/inventory.py",
      'hidden=_width(text, dims, "hidden"), vocab=_width(text, dims, "vocab"),',
      'hidden=_width(text, dims, "hidden"), vocab=dims.vocab if dims else 0,',
      ("tests/test_planner_coverage.py", "-k", "boundary_activations")),
]
