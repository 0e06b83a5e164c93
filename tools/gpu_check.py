"""Every device path of tensorpar on this host's GPUs, one verdict line each.

    python tools/gpu_check.py                      # all checks on the visible GPUs (under 5 minutes on one H200)
    python tools/gpu_check.py --gpus 1 --timeout 120
    python tools/gpu_check.py --device cpu --quick  # the same checks on the host over gloo (tests/test_gpu_check.py)

One line per check, then a summary; exit status 0 only if no check failed::

    PASS launch: nccl x1 on cuda:0: group formed, all_reduce exact (device and host tensors) (0.4 s)
    FAIL lean_decode: rank 1: greedy: lean tokens [[...]] != dense [[...]] (2.1 s)
    SKIP calibrate: `tensorpar calibrate` does not exist yet (...) (0.3 s)

The checks (``tools/gpu_check_paths.py``; tolerances stated there: float64 1e-10, float32 1e-4,
collectives and tokens exact):

- ``launch``: ``tensorpar.distributed.launch`` on the backend, an all-reduce through
  torch.distributed of a device tensor and through tensorpar of a host tensor, exact;
- ``collectives``: tensorpar's all_reduce (sum, max, a strided view), all_gather, reduce_scatter
  and broadcast on device and host tensors, bit for bit;
- ``shm``: the same over a shared-memory group (``backend="shm"``), which must pass GPU tensors on
  to gloo rather than put them in its segment;
- ``parallelize``: a tiny Llama on the device split over the ranks, logits and every gradient
  shard against the dense model (float64; float32 too unless ``--quick``);
- ``load_sharded``: ``load_sharded(device=)`` of a tiny checkpoint, every tensor on the device,
  logits against transformers' own load;
- ``lean_decode``: ``generate(engine="lean")`` of the split model against the dense model's own
  forward: the same tokens (greedy; top-k sampling too unless ``--quick``), step logits;
- ``train_mesh``: AdamW steps with clipping on dp x tp meshes (DDP, FSDP2, sequence parallelism)
  against the dense single-process run, step by step;
- ``checkpoint``: ``tensorpar.save`` at one layout, ``load`` at another into other weights, the
  resumed steps against the uninterrupted run;
- ``calibrate``: ``tensorpar calibrate --ranks 2 --out FILE --quick`` in a subprocess writes a
  JSON profile (SKIP while the command does not exist; its full run is the command's own).

Where the ranks run (torch 2.13): NCCL refuses two ranks of one communicator on one GPU
("Duplicate GPU detected"), so with two or more GPUs every check runs 2 ranks on NCCL, rank r on
cuda:r; with one GPU, ``launch`` runs NCCL at world size 1 and the other checks run 2 ranks on
gloo with both ranks' tensors on cuda:0. Gloo moves CUDA tensors for all-reduce, all-gather,
broadcast and reduce-scatter (through pinned host memory); its point-to-point sends read host
memory only, and tensorpar's reduce-scatter over gloo moves GPU tensors through the host itself.
Without a GPU every check prints SKIP (no GPU), unless ``--device cpu`` runs them on the host.

Each check runs in a subprocess of its own (one launch of its ranks) bounded by ``--timeout``
seconds, so a hang or a crash is that check's FAIL and the others still run; ``--quick`` runs
every check of one backend in a single launch (cheaper: what CI runs on the host) and shrinks
the work (fewer steps, one dtype, greedy decoding only).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHED = ("launch", "collectives", "shm", "parallelize", "load_sharded", "lean_decode", "train_mesh", "checkpoint")
CHECKS = LAUNCHED + ("calibrate",)
COLLECTIVE_TIMEOUT_S = 60.0


@dataclass
class Verdict:
    status: str  # PASS | FAIL | SKIP
    name: str
    detail: str
    seconds: float

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.detail} ({self.seconds:.1f} s)"


def verdict(name: str, results: list, world: int, error: str | None = None, seconds: float = 0.0) -> Verdict:
    """One check's verdict from its ranks' results (``{"rank", "status", "detail", "seconds"}``):
    FAIL when any rank failed (the lowest such rank's detail), or fewer than ``world`` ranks
    reported (``error``: why the launch ended), or ranks disagree on skipping; SKIP when every rank
    skipped; else PASS with rank 0's detail. ``seconds``: the slowest rank's, else ``seconds``."""
    results = sorted(results, key=lambda r: r["rank"])
    took = max((r["seconds"] for r in results), default=seconds)
    failed = [r for r in results if r["status"] == "FAIL"]
    if failed:
        return Verdict("FAIL", name, f"rank {failed[0]['rank']}: {failed[0]['detail']}", took)
    if len(results) < world:
        why = error or "the launch ended first"
        return Verdict("FAIL", name, f"{len(results)} of {world} ranks reported: {why}", max(took, seconds))
    kinds = {r["status"] for r in results}
    if kinds == {"SKIP"}:
        return Verdict("SKIP", name, results[0]["detail"], took)
    if kinds != {"PASS"}:
        return Verdict("FAIL", name, f"ranks disagree: {sorted(kinds)}", took)
    return Verdict("PASS", name, results[0]["detail"], took)


def exit_code(verdicts: list) -> int:
    return 1 if any(v.status == "FAIL" for v in verdicts) else 0


def summary(verdicts: list, seconds: float) -> str:
    counts = {s: sum(v.status == s for v in verdicts) for s in ("PASS", "FAIL", "SKIP")}
    return (f"gpu_check: {len(verdicts)} checks, {counts['PASS']} PASS, {counts['FAIL']} FAIL, "
            f"{counts['SKIP']} SKIP in {seconds:.0f} s")


# ---- where each check runs --------------------------------------------------------------------------

def topology(name: str, device: str, gpus: int) -> tuple[str, int]:
    """``(backend, world size)`` of a launched check (see the module's note)."""
    if device == "cpu":
        return "gloo", 2
    if gpus >= 2:
        return "nccl", 2
    return ("nccl", 1) if name == "launch" else ("gloo", 2)


def batches(names: list, device: str, gpus: int, quick: bool) -> list:
    """The launches to make: ``[(backend, world, [checks])]``, one per check, or with ``quick``
    one per backend and world (the checks in their given order)."""
    out: list = []
    for name in names:
        backend, world = topology(name, device, gpus)
        if quick and out and out[-1][:2] == (backend, world):
            out[-1][2].append(name)
        else:
            out.append((backend, world, [name]))
    return out


def run_launch(backend: str, world: int, names: list, args, gpus: int) -> list:
    """One subprocess launching ``world`` ranks that run ``names``; a verdict per check from the
    ranks' result files, whatever became of the subprocess (a timeout or crash fails what it left)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        plan = {"checks": names, "device": args.device, "gpus": max(gpus, 1), "world": world, "backend": backend,
                "quick": args.quick, "tmp": tmp, "deadline": args.timeout}
        t0 = time.perf_counter()
        error = _child(plan, args.timeout)
        seconds = time.perf_counter() - t0
        results = _rank_results(Path(tmp))
    return [verdict(n, results.get(n, []), world, error, seconds) for n in names]


def _child(plan: dict, timeout: float) -> str | None:
    """Run the plan in ``python tools/gpu_check.py --child PLAN`` (its own session, killed whole on
    timeout); returns why it ended badly, or None."""
    path = [str(ROOT), str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(filter(None, path))}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(plan)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout + 30)  # the launch's own deadline is `timeout`
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"timed out after {timeout:.0f} s"
    if proc.returncode == 0:
        return None
    said = [line for line in out.splitlines() if line.startswith("launch failed: ")]
    tail = [line for line in out.splitlines() if line.strip()][-1:] or ["no output"]
    return said[-1][len("launch failed: "):] if said else f"exit status {proc.returncode}: {tail[0][:300]}"


def _rank_results(tmp: Path) -> dict:
    """``{check: [each rank's result]}`` from the ranks' ``rank<r>.jsonl`` files."""
    out: dict = {}
    for log in sorted(tmp.glob("rank*.jsonl")):
        for line in log.read_text().splitlines():
            r = json.loads(line)
            out.setdefault(r["name"], []).append(r)
    return out


def child_main(plan: dict) -> int:
    """In the subprocess: one launch of the plan's ranks (:func:`gpu_check_paths.rank_worker`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_check_paths as paths

    from tensorpar import distributed as dist
    try:
        dist.launch(paths.rank_worker, plan["world"], plan, backend=plan["backend"],
                    timeout=COLLECTIVE_TIMEOUT_S, deadline=plan["deadline"])
    except Exception as exc:  # noqa: BLE001 - reported on one line; the ranks' files say the rest
        print(f"launch failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:400]}", flush=True)
        return 1
    return 0


# ---- calibrate: another command, run as the user would ---------------------------------------------------

def check_calibrate(out_dir: Path, timeout: float, *, command=None) -> Verdict:
    """``tensorpar calibrate --ranks 2 --out FILE --quick`` (``command``: what runs as ``tensorpar
    calibrate``; the tool's test gives stand-ins): SKIP when the command does not exist, FAIL when
    it exits non-zero or leaves no JSON object in FILE. Its smoke run (``--quick``, where the
    command offers it): the path is what is checked here, a real profile is the command's own run."""
    cmd = list(command or [sys.executable, "-m", "tensorpar", "calibrate"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    helped = subprocess.run(cmd + ["--help"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    if helped.returncode != 0:
        said = (helped.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return Verdict("SKIP", "calibrate", f"`tensorpar calibrate` does not exist yet ({said})",
                       time.perf_counter() - t0)
    out = out_dir / "profile.json"
    extra = ["--quick"] if "--quick" in helped.stdout else []
    try:
        done = subprocess.run(cmd + ["--ranks", "2", "--out", str(out), *extra], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return Verdict("FAIL", "calibrate", f"timed out after {timeout:.0f} s", time.perf_counter() - t0)
    return _calibrate_verdict(done, out, time.perf_counter() - t0)


def _calibrate_verdict(done, out: Path, seconds: float) -> Verdict:
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return Verdict("FAIL", "calibrate", f"exit status {done.returncode}: {said}", seconds)
    try:
        profile = json.loads(out.read_text())
    except (OSError, ValueError) as exc:
        return Verdict("FAIL", "calibrate", f"no JSON profile in {out.name}: {exc}", seconds)
    if not isinstance(profile, dict) or not profile:
        return Verdict("FAIL", "calibrate", f"{out.name} holds {type(profile).__name__}, not a profile", seconds)
    return Verdict("PASS", "calibrate", f"wrote a profile of {len(profile)} fields ({', '.join(list(profile)[:4])})",
                   seconds)


# ---- the command ----------------------------------------------------------------------------------------

def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Run every device path of tensorpar; one PASS/FAIL/SKIP line each.")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default; SKIP without a GPU) or cpu: the same checks on the host over gloo")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: every visible one)")
    p.add_argument("--timeout", type=float, default=150.0,
                   help="seconds each check may take (with --quick: each launch of several)")
    p.add_argument("--quick", action="store_true", help="one launch per backend, less work per check")
    p.add_argument("--only", default="", help=f"comma-separated checks to run, of: {', '.join(CHECKS)}")
    p.add_argument("--skip", default="", help="comma-separated checks not to run")
    p.add_argument("--child", help=argparse.SUPPRESS)  # the subprocess of one launch (a JSON plan)
    args = p.parse_args(argv)
    for given in (args.only, args.skip):
        bad = [n for n in filter(None, given.split(",")) if n not in CHECKS]
        if bad:
            p.error(f"unknown checks {bad}; valid: {', '.join(CHECKS)}")
    if args.gpus is not None and args.gpus < 1:
        p.error(f"--gpus must be at least 1, got {args.gpus}")
    return args


def selected(args) -> list:
    only = set(filter(None, args.only.split(","))) or set(CHECKS)
    skip = set(filter(None, args.skip.split(",")))
    return [n for n in CHECKS if n in only and n not in skip]


def visible_gpus(args) -> int:
    if args.device == "cpu":
        return 0
    import torch
    count = torch.cuda.device_count()
    return count if args.gpus is None else min(args.gpus, count)


def run(args) -> list:
    """Every selected check's verdict, each printed as soon as it is known."""
    names, gpus = selected(args), visible_gpus(args)
    verdicts: list = []

    def report(v: Verdict) -> None:
        print(v.line(), flush=True)
        verdicts.append(v)

    if args.device == "cuda" and gpus == 0:
        for name in names:
            report(Verdict("SKIP", name, "no GPU (torch.cuda.device_count() is 0); --device cpu runs it on the host",
                           0.0))
        return verdicts
    for backend, world, group in batches([n for n in names if n in LAUNCHED], args.device, gpus, args.quick):
        for v in run_launch(backend, world, group, args, gpus):
            report(v)
    if "calibrate" in names:
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
            report(check_calibrate(Path(tmp), args.timeout))
    return verdicts


def main(argv=None) -> int:
    args = parse(argv)
    if args.child is not None:
        return child_main(json.loads(args.child))
    t0 = time.perf_counter()
    verdicts = run(args)
    print(summary(verdicts, time.perf_counter() - t0), flush=True)
    return exit_code(verdicts)


if __name__ == "__main__":
    sys.exit(main())
