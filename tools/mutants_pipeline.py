"""Mutants of pipeline stages (issue 22): each must make tests/test_pipeline.py fail."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from mutants import Mutant as M  # noqa: E402

PIPE = "tests/test_pipeline.py"
EXACT = (PIPE, "-k", "equals_the_single or exactly_one_stage")
MUTANTS = [
    M("[pipeline] a tied embedding's gradients not summed over its two stages", "distributed/pipelining.py",
      'collectives.all_reduce(total, group=group, module="pipeline.tied_embedding")', "pass", EXACT),
    M("[pipeline] a tied embedding's two copies on one rank not summed", "distributed/pipelining.py",
      "total.add_(g)", "pass", EXACT),
    M("[pipeline] a tied embedding's copies not given the sum", "distributed/pipelining.py",
      "g.copy_(total)", "pass", EXACT),
    M("[pipeline] clipping misses the other pipeline ranks' gradients", "models/training.py",
      'dist.all_reduce(sq, group=report.pp_group, module="clip_grad_norm")', "pass", EXACT),
    M("[pipeline] a tied embedding counted twice in the gradient norm", "sharding/pipeline.py",
      "p.tp_pp_replicas = 2 if tied_group is not None else len(ps)", "p.tp_pp_replicas = 1", EXACT),
    M("[pipeline] a later stage runs on the embedding's stand-in, not the hidden states it received",
      "sharding/stage_cut.py", "new_stack._modules[key] = _HandIn(box, anat.block_tuple)",
      "new_stack._modules[key] = _Skip(anat.block_tuple)", EXACT),
    M("[pipeline] a microbatch's loss over its own tokens, not the batch's", "sharding/pipelined.py",
      "return total / self._total[0]", "return total / (target != -100).sum()", EXACT),
    M("[pipeline] the extra blocks of an uneven cut go to the last stages", "architecture/pipeline.py",
      "return [base + (1 if s < extra else 0) for s in range(stages)]",
      "return [base + (1 if s >= stages - extra else 0) for s in range(stages)]", EXACT),
    M("[pipeline] the loss stays on the last stage's ranks", "sharding/pipelined.py",
      'dist.broadcast(loss, src=report.pp_last_rank, group=self._pp_group, module="train_step")', "pass", EXACT),
    M("[pipeline] train_step's loss not averaged over dp", "models/training.py",
      "value = value / report.dp_size", "value = value", EXACT),
    M("[pipeline] a stage's own parameters (embedding, norm, head) left out of data parallelism",
      "distributed/dp_engines.py", 'replicate(stage, mesh=mesh["dp"])', "pass", EXACT),
    M("[pipeline] the cut not proved: a model whose forward does more than its blocks in order is cut anyway",
      "sharding/stage_cut.py", "_prove(model, out, ranges, ids, reference)", "pass",
      ("tests/test_pipeline_archs.py", "-k", "hrm_text or dory")),
    M("[pipeline] a piece registered after the blocks but run before them is held by the last stage",
      "sharding/stage_cut.py", "if ran_before != registered_before or (not ran_before and order.index(name) < last_block):",
      "if False:", ("tests/test_pipeline_archs.py", "-k", "bart or gemma4_text or xlm")),
    M("[pipeline] the planner sends the whole hidden states from every tp rank (the runtime sends slices)",
      "planner/pipeline_step.py", "return inv.tp > 1 and not sequence_parallel and inv.hidden % inv.tp == 0",
      "return False", (PIPE, "-k", "planner_equals_the_ledger")),
    M("[pipeline] zero-bubble schedules keep the fused linear + all-reduce node (its all-reduce runs twice)",
      "sharding/pipeline.py", "mod.fuse_grad_allreduce = False", "pass", (PIPE, "-k", "planner_equals_the_ledger")),
    M("[pipeline] microbatches that do not divide the batch run anyway", "sharding/pipelined.py",
      "if input_ids.dim() != 2 or input_ids.shape[0] % self.microbatches:", "if False:",
      (PIPE, "-k", "cannot_run")),
]
