"""`make mutants`: deliberate one-line faults, each run against the tests that claim to catch it.

A test suite that passes when the code is wrong proves nothing. Each mutant below replaces one
line of tensorpar with a plausible mistake (a collective skipped, a mask ignored, a check turned
off, a formula off by a factor); this script applies it to a copy of the working tree, runs the
tests that should fail, and reports the mutants that survive (their tests still passed). None
may survive: a survivor is a gap in the tests, to be closed by a test that fails on it.

The list below holds the first ones; tools/mutants_<area>.py hold those of each later area.

    python tools/mutants.py            # all
    python tools/mutants.py verify     # those whose name contains "verify"
    python tools/mutants.py --baseline # first check each selection passes unmutated

Not part of `make test` (about 20 s to 2 min per mutant on 2 cores).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # under tensorpar/
    old: str  # one line (stripped of its indentation), found exactly once in the file
    new: str
    tests: tuple  # pytest arguments: the tests that must fail


M = Mutant
MUTANTS = [
    # distributed/: the collectives, the ledger, the launcher, the flight recorder
    M("all_reduce skipped over gloo", "distributed/collectives.py",
      "work = tdist.all_reduce(buf, op=_OPS[op], group=group, async_op=async_op)", "work = None",
      ("tests/test_dist.py", "-k", "mappings_forward_and_backward")),
    M("all_reduce skipped over shared memory", "distributed/collectives.py",
      "work = shm.all_reduce(segment, x, op)", "work = None",  # the path under a ledger
      ("tests/test_dist.py", "-k", "ledger_records_every_collective")),
    M("copy_to_tp_region's backward not reduced", "distributed/mappings.py",
      "return collectives.all_reduce(_fresh(grad), ctx.group, **_bwd(ctx)), None", "return _fresh(grad), None",
      ("tests/test_dist.py", "-k", "mappings_forward_and_backward")),
    M("ledger counts all-reduce bytes as an all-gather's", "architecture/ring.py",
      'factors = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p}',
      'factors = {"all_reduce": (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p}',
      ("tests/test_dist.py", "-k", "ledger_records_every_collective")),
    M("gloo broadcast recorded as a chain (gloo sends a tree)", "distributed/collectives.py",
      'algorithm = {"gloo": "tree", "shm": "shared"}.get(transport(group), "chain")',
      'algorithm = {"shm": "shared"}.get(transport(group), "chain")',
      ("tests/test_dist.py", "-k", "sockets_carry")),
    M("wire counter takes the bytes received for the bytes sent", "distributed/wire.py",
      'sent += (struct.unpack_from("Q", info, _BYTES_SENT)[0] - struct.unpack_from("Q", info, _BYTES_RETRANS)[0]',
      'sent += (struct.unpack_from("Q", info, _BYTES_RECEIVED)[0] - struct.unpack_from("Q", info, _BYTES_RETRANS)[0]',
      ("tests/test_dist.py", "-k", "sockets_carry")),
    # distributed/shm: the shared-memory transport
    M("shared memory sums in another order than rank order", "distributed/shm.py",
      "for r in range(1, s.size):  # rank order on every rank: the same bits everywhere",
      "for r in range(s.size - 1, 0, -1):",
      ("tests/test_dist_shm.py", "-k", "exact")),
    M("shared memory reads peers' slots before they arrive", "distributed/shm_segment.py",
      'self._wait(self._arrive(r), g, r, "arrive")', "pass",
      ("tests/test_dist_shm.py", "-k", "exact")),
    M("shared-memory segment readable by other users", "distributed/shm_segment.py",
      "fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)",
      "fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)",
      ("tests/test_dist_shm.py", "-k", "private")),
    M("shared-memory segment never unlinked", "distributed/shm.py",
      "os.unlink(segment.path)  # every rank has it mapped (or gave up): nothing stays in /dev/shm", "pass",
      ("tests/test_dist_shm.py", "-k", "unlinked_while")),
    M("a waiting rank spins instead of sleeping", "distributed/shm_segment.py",
      "_syscall(_SYS_FUTEX, self._base + 4 * index, _FUTEX_WAIT, seen, ctypes.byref(_SLICE), None, 0)", "pass",
      ("tests/test_dist_shm.py", "-k", "sleeps")),
    M("shared memory reads a peer's bytes whatever it issued", "distributed/shm_segment.py",
      "if theirs != (op, nbytes & _MASK):", "if False:",
      ("tests/test_dist_shm.py", "-k", "sizes")),
    # bench/: the floor is a tensor-parallel MLP, not something cheaper
    M("bench floor without its forward all-reduce", "bench/mlp.py",
      "reduce(y_partial.detach())  # forward all-reduce of the output, in place", "pass",
      ("tests/test_bench.py", "-k", "floor_computes")),
    M("bench floor without its backward all-reduce of dX", "bench/mlp.py",
      "reduce(xx.grad)  # backward all-reduce of dX", "pass",
      ("tests/test_bench.py", "-k", "floor_computes")),
    M("a deep copy of a split model loses its parameters' tags", "sharding/commit.py",
      'if tags and not hasattr(p, "tp_spec"):', "if False:",
      ("tests/test_sharding_audit.py", "-k", "deep_copy")),
    M("the reaper kills nothing when the launcher dies", "distributed/reaper.py",
      "os.killpg(pid, signal.SIGKILL)  # the rank's group: the rank and what it started", "pass",
      ("tests/test_dist.py", "-k", "killed_launcher")),
    M("wire bytes never recorded", "distributed/collectives.py",
      "led.set_wire(index, after[0] - before[0], after[1] - before[1])", "pass",
      ("tests/test_dist.py", "-k", "sockets_carry")),
    M("launcher blames the peer that lost its connection", "distributed/launcher.py",
      "own = [f for f in failures if not any(s in f.detail for s in _PEER_LOSS)]",
      "own = [f for f in failures if any(s in f.detail for s in _PEER_LOSS)]",
      ("tests/test_dist.py", "-k", "blamed")),
    M("flight recorder ignores different collectives", "distributed/flight.py",
      'if sa["seq"] == sb["seq"] and _signature(sa) != _signature(sb):', "if False:",
      ("tests/test_dist.py", "-k", "mismatch")),
    M("signature check passes everything", "distributed/flight.py",
      "if bool((rows == mine).all()):", "if True:",
      ("tests/test_dist.py", "-k", "rank_side")),
    # nn/: layers and attention
    M("attention ignores its mask", "nn/attention_ops.py",
      "o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,",
      "o = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=dropout_p,",
      ("tests/test_nn_attention_core.py",)),
    M("attention forgets the cache's positions", "nn/attention_ops.py",
      "offset = 0 if cache is None else cache.seq_len", "offset = 0",
      ("tests/test_nn_attention_core.py",)),
    M("vocab-parallel embedding keeps other ranks' rows", "nn/layers.py",
      "return out_partial.masked_fill_(outside.unsqueeze(-1), 0.0)", "return out_partial",
      ("tests/test_nn_layers.py",)),
    # sharding/: the proof's companions, audit
    M("audit sees no drift", "sharding/audit.py", "if ranks:", "if False:",
      ("tests/test_sharding_audit.py",)),
    M("different prompts accepted", "sharding/audit.py", "if bad:", "if False:",
      ("tests/test_sharding_audit.py",)),
    M("gradient of a per-head parameter not synchronised", "nn/regions.py",
      'param.tp_rows_sync = {"rows": tuple(rows), "slot": slot, "n_slots": n_slots, "name": name}',
      'return None',
      ("tests/test_sharding_runtime.py",)),
    # the jobs: verify's comparison
    M("verify skips a lost gradient", "jobs/verify.py",
      'return float("inf"), float("inf")', "continue",
      ("tests/test_jobs_verify_compare.py",)),
    M("verify judges rounding noise by itself", "jobs/verify.py",
      "return min(rel / tol, vs_rounding)", "return rel / tol",
      ("tests/test_jobs_verify_compare.py",)),
    M("verify judges by the tolerance alone, never by rounding", "jobs/verify.py",
      "if exact is None or split is None or dense is None:", "if True:",
      ("tests/test_jobs_verify_compare.py",)),
    # models/: loaders, training, generation
    M("checkpoint shapes not checked", "models/checkpoint.py",
      "if src.shape != tuple(shapes[names[0]].shape):", "if False:",
      ("tests/test_cli_jobs.py", "-k", "errors_are_one_line")),
    M("an index may name files outside the folder", "models/checkpoint.py",
      "if outside:", "if False:",
      ("tests/test_cli_jobs.py", "-k", "errors_are_one_line")),
    M("config may ask for more layers than the checkpoint holds", "models/checkpoint.py",
      "if isinstance(v, int) and v > max(held) + 1:", "if False:",
      ("tests/test_cli_jobs.py", "-k", "errors_are_one_line")),
    M("non-finite weights compared as if finite", "jobs/verify.py",
      "check.nonfinite = nonfinite(dense)", "check.nonfinite = []",
      ("tests/test_cli_jobs.py", "-k", "non_finite")),
    M("plan exits 0 for a layout that does not fit", "cli/plan.py",
      "return 0 if _feasible(result) else 1", "return 0",
      ("tests/test_planner_cli.py",)),
    M("clipping counts shared rows on every rank", "models/training.py",
      "sq = sq - shared * (1 - 1 / r)", "sq = sq",
      ("tests/test_sharding_runtime.py",)),
    M("the split model discards its KV cache", "models/generation.py",
      'cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)',
      'cache = None if self.group is not False else (getattr(out, "cache", None) or getattr(out, "past_key_values", None))',
      ("tests/test_cli_jobs.py", "-k", "decoder_generates")),
    M("next token chosen from a shard's local indices", "models/generation.py",
      "values, indices = _best_k(local, start, k)  # (B, k)", "values, indices = _best_k(local, 0, k)",
      ("tests/test_models_generation.py", "-k", "every_row")),
    M("left-padded prompts without their positions", "models/generation.py",
      'kwargs["position_ids"] = positions', "pass",
      ("tests/test_models_generation.py", "-k", "every_row")),
    M("stopped rows not padded", "models/generation.py", "nxt = nxt.masked_fill(done, pad)", "pass",
      ("tests/test_models_generation.py", "-k", "stop_token")),
    M("lean forward: a row split's bias added before its all-reduce", "models/lean.py",
      "y_partial = torch.mm(x, wt)                                      # (B T, H)", "y_partial = _mm(x, (wt, bias))",
      ("tests/test_models_lean.py", "-k", "split_lean_equals")),
    M("lean forward: padding keys attended", "models/lean.py",
      "return (causal & keys) | (cols == rows)                           # (B, 1, T, L)", "return causal",
      ("tests/test_models_lean.py", "-k", "dense_lean_equals")),
    M("lean forward: rotation without rotate_half's sign", "models/lean.py",
      "return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed",
      "return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed.abs()",
      ("tests/test_models_lean.py", "-k", "dense_lean_equals")),
    M("lean forward steps over any partial hook", "nn/regions.py",
      "entry = isinstance(hook, partial) and hook.func in (_copy_in, _copy_all)", "entry = isinstance(hook, partial)",
      ("tests/test_models_lean.py", "-k", "must_not_run")),
    M("shared-memory views made under inference mode", "distributed/shm_segment.py",
      "with torch.inference_mode(False):  # made under inference mode, a view could not be written outside it",
      "with torch.inference_mode(torch.is_inference_mode_enabled()):",
      ("tests/test_dist_shm.py", "-k", "inference_mode")),
    M("FSDP clipping without the other dp ranks' rows", "models/training.py",
      "dist.all_reduce(sq, group=report.dp_group, module=\"clip_grad_norm\")", "pass",
      ("tests/test_models_mesh.py", "-k", "equals_the_single")),
    M("data parallelism asked for, none applied", "distributed/dp_engines.py",
      "replicate(model, process_group=dp_mesh.get_group())", "pass",
      ("tests/test_models_mesh.py", "-k", "equals_the_single")),
    M("checkpoint blocks placed where they sit in the shard, not in the dense tensor", "models/saving.py",
      "blocks.append(((a + lo2 - lo,) + (0,) * (len(shape) - 1), local.narrow(0, lo2 - rows[0], hi2 - lo2)))",
      "blocks.append(((lo2,) + (0,) * (len(shape) - 1), local.narrow(0, lo2 - rows[0], hi2 - lo2)))",
      ("tests/test_models_saving.py", "-k", "resumed_run and saved-dp2xtp2-ddp")),
    M("optimizer state not loaded", "models/saving.py",
      "state = _state(model, optimizer, 0)", "state = _state(model, None, 0)",
      ("tests/test_models_saving.py", "-k", "resumed_run and saved-dp2xtp2-ddp")),
    M("Gumbel noise of the wrong sign", "models/sampling.py",
      "return -torch.log(-torch.log(uniform(sampler.seed, step, batch, vocab_size)))",
      "return torch.log(-torch.log(uniform(sampler.seed, step, batch, vocab_size)))",
      ("tests/test_models_generation.py", "-k", "distribution")),
    M("nucleus keeps every token", "models/sampling.py",
      "drop_sorted = before >= top_p  # the first is always kept (before = 0 < top_p)", "drop_sorted = before > 1",
      ("tests/test_models_generation.py", "-k", "distribution or independent")),
    # reference/ and planner/
    M("numpy MLP adds the bias on every rank", "reference/seed.py",
      "return y if b2 is None else y + b2", "return y if b2 is None else y + len(y_partials) * b2",
      ("tests/test_reference_seed.py",)),
    M("planner predicts no next-token exchange", "planner/runtime.py", "if step.next_token:", "if False:",
      ("tests/test_planner_inventory_ranks.py", "-k", "decode_steps")),
    M("planner: a fused q/k/v's replicated KV rows reduced as separate K and V projections", "planner/comm.py",
      'if model.family == "gpt":  # one fused q/k/v projection (GPT-BigCode): its weight\'s KV rows, then its bias\'s',
      "if False:", ("tests/test_planner_agreement.py", "-k", "gpt_bigcode")),
    M("registry: Qwen3's closed forms without its q/k norms", "architecture/registry.py",
      'Arch("qwen3", formulas=Formulas("llama", "Qwen3ForCausalLM", refuse=("attention_bias",), qk_norm=True,',
      'Arch("qwen3", formulas=Formulas("llama", "Qwen3ForCausalLM", refuse=("attention_bias",), qk_norm=False,',
      ("tests/test_planner_agreement.py", "-k", "qwen3")),
    M("registry: GPT-BigCode's closed forms with every KV head", "architecture/registry.py",
      'formulas=Formulas("gpt", "GPTBigCodeForCausalLM", refuse=("add_cross_attention",), multi_query=True)),',
      'formulas=Formulas("gpt", "GPTBigCodeForCausalLM", refuse=("add_cross_attention",), multi_query=False)),',
      ("tests/test_planner_agreement.py", "-k", "gpt_bigcode")),
    M("planner's KV cache counts K only", "planner/memory.py",
      "per_device = 2 * layers_per_stage(model, pp) * g_t * model.head_dim * bytes_per_elem",
      "per_device = layers_per_stage(model, pp) * g_t * model.head_dim * bytes_per_elem",
      ("tests/test_planner_formulas.py", "tests/test_planner_cases.py")),
    M("planner's Adam state for mixed precision", "planner/memory.py",
      "return 12 if bytes_per_elem < 4 else 2 * bytes_per_elem", "return 8 if bytes_per_elem < 4 else 2 * bytes_per_elem",
      ("tests/test_planner_formulas.py", "tests/test_planner_cases.py")),
    # jobs/verify: the two questions, the routers' replay, the structure tolerance
    M("a layer ok when only the rounding check passes", "jobs/verify.py",
      "return cls(name, act, grad, pgrad, excess <= 1.0 and structure <= 1.0, excess, structure,",
      "return cls(name, act, grad, pgrad, excess <= 1.0, excess, structure,",
      ("tests/test_jobs_verify_compare.py", "-k", "both_questions")),
    M("routers' choices recorded but not replayed", "jobs/routing.py",
      "return torch.return_types.topk((x.gather(dim, idx), idx))", "return out",
      ("tests/test_cli_jobs.py", "-k", "replays")),
    M("structure judged at float64 where the model computes in float32", "jobs/verify.py",
      "return TOLERANCE[routing.lowest]", "return TOLERANCE[torch.float64]",
      ("tests/test_cli_jobs.py", "-k", "replays")),
    # issue 13: sequence parallelism, the ledger of PyTorch's own collectives, the planner on the mesh
    M("sequence parallel: norm gradients left partial", "sharding/sequence.py",
      "regions.sync_grad(mod, attr, tp_group)", "pass",
      ("tests/test_models_sequence.py", "-k", "dense_model or wrong")),
    M("sequence parallel: row linears keep their all-reduce", "sharding/sequence.py",
      'undo.set_attr(mod, "sequence_parallel", True)  # leaves by reduce-scatter', "pass",
      ("tests/test_models_sequence.py", "-k", "dense_model and llama")),
    M("DDP / FSDP collectives not recorded", "distributed/shm.py",
      "if led is None or flight.own_call():", "if True:",
      ("tests/test_planner_mesh.py", "-k", "collectives")),
    M("planner: FSDP blocks not gathered again in backward", "planner/mesh.py",
      "if unit:", "if False:",
      ("tests/test_planner_mesh.py", "-k", "collectives and fsdp")),
    M("planner: FSDP shards not padded", "planner/mesh.py",
      "return -(-rows // dp) * dp", "return rows",
      ("tests/test_planner_mesh.py",)),
    M("dropout: regions draw from the shared generator", "sharding/commit.py",
      "if has_dropout(module):  # masks on its heads (or columns) must differ from rank to rank,", "if False:",
      ("tests/test_models_sequence.py", "-k", "dropout")),
    M("each rank names the checkpoint folder by its own look at the disk", "models/saving.py",
      "return dist.broadcast_object(None)",
      "nonce, name = dist.broadcast_object(None)[0], f'step-{step:08d}'; "
      "return nonce, (f'{name}.{nonce}' if os.path.lexists(root / name) else name)",
      ("tests/test_models_saving.py", "-k", "published")),
    M("dropout: the tensor-parallel generator not restored on load", "models/saving.py",
      'model.__dict__["_tp_rng_fork"].tracker.set_state(TP_RNG, state[_tp_rng_key()])', "pass",
      ("tests/test_models_saving.py", "-k", "dropout")),
]


def _by_area() -> list:
    """The catalogue's other parts: ``tools/mutants_<area>.py``, each a ``MUTANTS`` list of
    :class:`Mutant` for one area (checkpoints, launch, runtime, train)."""
    import importlib.util

    out = []
    for path in sorted(Path(__file__).parent.glob("mutants_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out += module.MUTANTS
    return out


def _copy_tree(dest: Path) -> None:
    """The working tree's files (tracked and untracked, not ignored) into ``dest``."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def _apply(tree: Path, m: Mutant) -> str:
    """Write the mutant into ``tree``; return the original text to restore."""
    path = tree / "tensorpar" / m.path
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.strip() == m.old]
    if len(hits) != 1:
        raise SystemExit(f"mutant {m.name!r}: expected the line once in tensorpar/{m.path}, found it "
                         f"{len(hits)} times: {m.old!r} (the code moved on: update tools/mutants.py)")
    line = lines[hits[0]]
    lines[hits[0]] = line[:len(line) - len(line.lstrip())] + m.new + "\n"
    path.write_text("".join(lines))
    return text


def _pytest(tree: Path, tests: tuple):
    python = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv").exists() else sys.executable
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        return subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests], cwd=tree,
                              env=env, capture_output=True, text=True, timeout=900).returncode
    except subprocess.TimeoutExpired:
        return "timeout"


def baseline(selected: list[Mutant]) -> bool:
    """Every selection passes on the unmutated copy (else a mutant's failure proves nothing)."""
    ok = True
    with tempfile.TemporaryDirectory(prefix="tensorpar-mutants-") as tmp:
        _copy_tree(Path(tmp))
        for tests in dict.fromkeys(m.tests for m in selected):
            rc = _pytest(Path(tmp), tests)
            print(f"{'passes  ' if rc == 0 else 'FAILS   '} unmutated: {' '.join(tests)} (rc {rc})", flush=True)
            ok = ok and rc == 0
    return ok


def run(selected: list[Mutant]) -> list[Mutant]:
    survivors = []
    with tempfile.TemporaryDirectory(prefix="tensorpar-mutants-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        for m in selected:
            original = _apply(tree, m)
            t0 = time.monotonic()
            try:
                rc = _pytest(tree, m.tests)
            finally:
                (tree / "tensorpar" / m.path).write_text(original)
            caught = rc not in (0, 5)  # 5: no test ran, which catches nothing
            print(f"{'caught  ' if caught else 'SURVIVED'} {m.name:52s} ({time.monotonic() - t0:5.0f} s, rc {rc})",
                  flush=True)
            if not caught:
                survivors.append(m)
    return survivors


def main(argv: list[str]) -> int:
    check_first = "--baseline" in argv
    argv = [a for a in argv if a != "--baseline"]
    selected = [m for m in MUTANTS + _by_area() if not argv or any(a in m.name for a in argv)]
    print(f"{len(selected)} mutants", flush=True)
    if check_first and not baseline(selected):
        print("a selection fails without any mutant: fix the tests first")
        return 2
    survivors = run(selected)
    if survivors:
        print(f"{len(survivors)} survived: " + "; ".join(m.name for m in survivors))
        return 1
    print(f"all {len(selected)} caught")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
