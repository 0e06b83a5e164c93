"""Mutants of the time estimates (issue 23): each must make tests/test_planner_estimate.py fail."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from mutants import Mutant as M  # noqa: E402

EST = ("tests/test_planner_estimate.py",)
MUTANTS = [
    M("[estimate] backward as one GEMM per forward GEMM, not two", "planner/estimate.py",
      "work = {k: 3.0 * v for k, v in fwd.items()}  # forward once, backward twice",
      "work = {k: 2.0 * v for k, v in fwd.items()}", EST),
    M("[estimate] full recomputation re-runs the head too", "planner/estimate.py",
      "again = forward_terms(split, _body(split, stage), rank, **kw)", "again = forward_terms(split, stage, rank, **kw)", EST),
    M("[estimate] a GEMM's operand bytes left out", "planner/profile.py",
      "work = 2.0 * m * n * k / self.rate_flops + bytes_per_elem * (m * k + k * n + m * n) / self.bytes_per_s",
      "work = 2.0 * m * n * k / self.rate_flops", EST),
    M("[estimate] the bubble added as a share of the busy time, not of the step", "planner/estimate.py",
      'terms["bubble_s"] = busy * f / (1.0 - f) if f < 1 else 0.0', 'terms["bubble_s"] = busy * f', EST),
    M("[estimate] data-parallel reduction never overlapped", "planner/estimate.py",
      "if runtime.dp_overlap and dp > 0:", "if False:", EST),
    M("[estimate] the last bucket may overlap too", "planner/estimate.py",
      "dp = max(dp - backward, last)", "dp = max(dp - backward, 0.0)", EST),
    M("[estimate] a tied head's GEMM not counted (its weight is found under the embedding's name)",
      "planner/estimate.py", "return {name: p for p in split.params for name in (p.name, *p.tied)}",
      "return {p.name: p for p in split.params}", EST),
    M("[estimate] every head's keys and values read (grouped heads do not share them)", "planner/estimate.py",
      "operands = e * (heads * queries * (a.qk_dim + a.v_dim) + batch * c * a.kv[rank])",
      "operands = e * (heads * queries * (a.qk_dim + a.v_dim) + heads * c * (a.qk_dim + a.v_dim))", EST),
    M("[estimate] an unmeasured group size keeps the measured one's bytes per rank", "planner/profile.py",
      'beta = fit["beta_s_per_byte"] * (_ring(op, p) / _ring(op, near) if near > 1 else 1.0)',
      'beta = fit["beta_s_per_byte"]', EST),
    M("[estimate] links at their line rate (no nccl-tests efficiency)", "planner/profile.py",
      'eff = f["link_of_line_rate"]', "eff = 1.0", EST),
    M("[estimate] the optimizer's bytes not scaled to 16-bit states", "planner/estimate.py",
      "terms[\"optimizer_s\"] = params * runtime.optimizer_bytes_per_param * (e if e < 4 else 4) / 4 \\",
      "terms[\"optimizer_s\"] = 0.0 * params * runtime.optimizer_bytes_per_param * (e if e < 4 else 4) / 4 \\", EST),
    M("[estimate] search-tp's stopping point: any slower tp, not one that is less than 5% faster",
      "planner/tp_search.py",
      "return next((b for (_, ta), (b, tb) in zip(times, times[1:]) if tb > (1 - PAYS) * ta), None)",
      "return next((b for (_, ta), (b, tb) in zip(times, times[1:]) if tb > ta), None)", EST),
    M("[estimate] the latency override replaces beta too", "planner/profile.py",
      'links = {name: Link(name, {op: {p: {**fit, "alpha_s": float(latency_s)} for p, fit in table.items()}',
      'links = {name: Link(name, {op: {p: {**fit, "alpha_s": float(latency_s), "beta_s_per_byte": 0.0} for p, fit in table.items()}',
      EST),
]
