"""docs/bench/host_memory.md: training steps with the rank keeping the host memory it frees
(``TENSORPAR_HOST_MEMORY=keep``, the default: :mod:`tensorpar.distributed.host_memory`) beside
glibc's defaults (``system``), page faults and step time.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python tools/host_memory_bench.py     # ~2 min

The setting is a process's, so each round is two launches of 2 ranks, one per setting, their
order alternating round to round. Each launch builds the estimates suite's four training cases of
the ~25M Llama (``tensorpar.bench.estimates``: tp 2, dp 2 DDP, dp 2 FSDP, pp 2), one at a time, and
times ``STEPS`` steps of each after two of warm-up, with ``ru_minflt`` (minor page faults, 4 KiB
each) around each step; a figure is the slower rank's median step. The ratio is the median over
rounds of the round's system / keep.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tensorpar import distributed as dist  # noqa: E402
from tensorpar.architecture.tiny_sizes import BENCH_LLAMA  # noqa: E402
from tensorpar.bench import estimates  # noqa: E402
from tensorpar.models.tiny import make_tiny_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5
SETTINGS = ("keep", "system")


def worker(path: str, steps: int) -> dict:
    """``{case: (median step seconds, median MB of page faults a step)}`` on this rank."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dist.check_collectives(False)
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    ids = torch.randint(0, dense.config.vocab_size, (estimates.BATCH, estimates.SEQ),
                        generator=torch.Generator().manual_seed(0))
    out = {}
    for name, (_, build) in estimates._train_cases(dense, ids).items():
        step = build()
        for _ in range(2):
            step()
        times, faults = [], []
        for _ in range(steps):
            dist.barrier()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / 1e6)
        out[name] = (statistics.median(times), statistics.median(faults))
        del step
        gc.collect()
    return out


def measure(rounds: int, steps: int) -> list:
    """``[{setting: {case: (seconds, MB)}}]`` per round, the slower rank's of each."""
    out = []
    with tempfile.TemporaryDirectory(prefix="tensorpar-host-memory-") as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "llama", "llama", dtype=torch.float32, **BENCH_LLAMA)
        for i in range(rounds):
            row = {}
            for setting in SETTINGS[::1 if i % 2 == 0 else -1]:
                os.environ["TENSORPAR_HOST_MEMORY"] = setting
                ranks = dist.launch(worker, 2, str(path), steps, backend="auto", timeout=600)
                row[setting] = {case: (max(r[case][0] for r in ranks), max(r[case][1] for r in ranks))
                                for case in ranks[0]}
            out.append(row)
    os.environ.pop("TENSORPAR_HOST_MEMORY", None)
    return out


def page(results: list, start: str, end: str, steps: int) -> str:
    cases = list(results[0]["keep"])
    lines = [
        "# Benchmark: a rank that keeps the host memory it frees, beside glibc's defaults", "",
        f"`HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python tools/host_memory_bench.py`, {start} to {end} UTC, on this "
        f"project's machine (2 CPUs), torch {torch.__version__}: {len(results)} rounds, each one launch of 2 ranks "
        f"with `TENSORPAR_HOST_MEMORY=keep` (the default) and one with `system` (glibc's defaults), their order "
        f"alternating. Each launch times {steps} steps of each of the estimates suite's training cases of the ~25M "
        "Llama (one at a time, after two steps of warm-up) with the minor page faults around each step; each "
        "figure is the slower rank's median, the ratio the median over rounds of system / keep (above 1: glibc's "
        "defaults are slower). What it does: [reliability.md](../reliability.md#host-memory-a-rank-frees-stays-in-"
        "the-rank).", "",
        "| case | page faults a step, keep | system | step, keep | system | system / keep |",
        "|---|---:|---:|---:|---:|---:|"]
    for case in cases:
        def med(setting, j):
            return statistics.median(r[setting][case][j] for r in results)
        ratio = statistics.median(r["system"][case][0] / r["keep"][case][0] for r in results)
        lines.append(f"| {case} | {med('keep', 1):.1f} MB | {med('system', 1):.1f} MB | {med('keep', 0) * 1e3:.0f} ms | "
                     f"{med('system', 0) * 1e3:.0f} ms | {ratio:.2f} |")
    lines += ["", "Each round's system / keep step time:", "",
              "| case | " + " | ".join(f"round {i + 1}" for i in range(len(results))) + " |",
              "|---|" + "---:|" * len(results)]
    for case in cases:
        lines.append(f"| {case} | " + " | ".join(f"{r['system'][case][0] / r['keep'][case][0]:.2f}" for r in results)
                     + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "host_memory.md")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        raise SystemExit(f"--rounds ({args.rounds}) and --steps ({args.steps}) must be at least 1")
    now = lambda: datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")  # noqa: E731
    start = now()
    results = measure(args.rounds, args.steps)
    args.out.write_text(page(results, start, now(), args.steps))
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
