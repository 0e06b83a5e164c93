"""docs/bench/estimates.md: `tensorpar calibrate` then `tensorpar bench --suite estimates`, three
times one after the other, and every case's measured / estimate in each run (issue 23's test).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python tools/estimates_page.py            # ~8-30 min
    .venv/bin/python tools/estimates_page.py --from bench/out/estimates-runs               # re-render

Each run's profile and bench output stay in ``--dir`` (default bench/out/estimates-runs); the page
shows the last run's table and every run's ratio beside the host's speed during it, and the
results file every run's rows and profiles. Run it on an idle machine: anything else running
slows the cases and not the calibration before them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorpar.bench.estimates import TARGET, estimates_table  # noqa: E402
from tensorpar.bench.host_speed import (DISPATCH_CEIL, SETTLE_BUDGET_S, SETTLE_FLOOR, SETTLE_WAIT_S,  # noqa: E402
                                         spell_note)

ROOT = Path(__file__).resolve().parents[1]
TENSORPAR = [sys.executable, "-m", "tensorpar"]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def run(dirpath: Path, runs: int, repeats: int) -> list:
    """``runs`` calibrations each followed by the estimates suite; ``[{"profile", "rows", "start", "end"}]``."""
    dirpath.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for i in range(1, runs + 1):
        profile, bench = dirpath / f"profile{i}.json", dirpath / f"bench{i}.json"
        start = _now()
        subprocess.run([*TENSORPAR, "calibrate", "--out", str(profile)], check=True, env=env, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        with bench.open("w") as f:
            subprocess.run([*TENSORPAR, "bench", "--suite", "estimates", "--profile", str(profile), "--repeats",
                            str(repeats), "--json"], check=True, env=env, cwd=ROOT, stdout=f)
        (dirpath / f"times{i}.json").write_text(json.dumps({"start": start, "end": _now(), "repeats": repeats}))
        print(f"run {i}: {start} - {_now()}", file=sys.stderr)
    return load(dirpath, runs)


def load(dirpath: Path, runs: int) -> list:
    out = []
    for i in range(1, runs + 1):
        times = json.loads((dirpath / f"times{i}.json").read_text())
        out.append({"profile": json.loads((dirpath / f"profile{i}.json").read_text()),
                    "rows": json.loads((dirpath / f"bench{i}.json").read_text())["results"]["estimates"], **times})
    return out


def page(runs: list) -> str:
    last = runs[-1]
    by_run = [{r["case"]: r for r in run["rows"]} for run in runs]
    cases = [r["case"] for r in last["rows"] if all(r["case"] in b for b in by_run)]
    measured = last["profile"].get("measured", {})
    always = [c for c in cases if all(b[c]["within_target"] for b in by_run)]
    missed = {c: [b[c]["measured_vs_estimate"] for b in by_run] for c in cases if c not in always}
    head = (f"# Benchmark: each case beside the planner's estimate of it\n\n"
            f"`HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python tools/estimates_page.py`: `tensorpar calibrate --out P`, then "
            f"`tensorpar bench --suite estimates --profile P` ({last.get('repeats', '?')} rounds), {len(runs)} times "
            f"one after the other, {runs[0]['start']} to {runs[-1]['end']} UTC, on this project's machine "
            f"({measured.get('cpu_count', '?')} CPUs), torch {measured.get('torch', '?')}. One launch of "
            f"{measured.get('ranks', '?')} ranks, {measured.get('threads_per_rank', '?')} thread per rank, float32, the ~25M Llama (`BENCH_LLAMA`). The last run's table below; every run's profile, "
            f"rows and samples, and the host's speed before each sample: "
            f"[estimates_results.json](estimates_results.json). What each case is: "
            f"[benchmarks.md](../benchmarks.md#estimates-each-case-beside-the-planners-estimate); the model: "
            f"[planner.md](../planner.md#time-estimates).\n\n")
    runs_head = "| case | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |\n|---|" + \
        "---:|" * len(runs) + "\n"
    runs_rows = "\n".join(f"| {c} | " + " | ".join(
        f"{b[c]['measured_vs_estimate']:.2f} ({b[c]['host_speed']:.2f})" if b[c].get("host_speed") is not None
        else f"{b[c]['measured_vs_estimate']:.2f}" for b in by_run) + " |" for c in cases)
    verdict = (f"**Within {TARGET:.0%} in every run: {len(always)} of {len(cases)} cases**"
               + (f" ({', '.join(always)})" if always and missed else "") + ".")
    if missed:
        verdict += " Outside it in at least one run: " + "; ".join(
            f"{c} ({', '.join(f'{x:.2f}' for x in v)})" for c, v in missed.items()) + "."
    waited = ""
    if all("host_wait_s" in r for run in runs for r in run["rows"]):  # runs from before the wait have no figure
        waits = [sum(r["host_wait_s"] for r in run["rows"]) for run in runs]
        waited = ("Before its samples, each run waited for the host in a slow spell (a GEMM probe under "
                  f"{SETTLE_FLOOR:.0%} of its calibrated speed, or a dispatch probe over {DISPATCH_CEIL:.2f}x the "
                  f"run's own; sleeping at most {SETTLE_WAIT_S:.0f} s a sample, "
                  f"{SETTLE_BUDGET_S:.0f} s a run; the speeds in brackets are the probes' after any wait): "
                  + ", ".join(f"run {i + 1} {w:.0f} s" for i, w in enumerate(waits)) + ".\n\n")
    checks = [(i, c) for i, run in enumerate(runs) if (c := run["profile"].get("measured", {}).get("check"))]
    if checks:  # profiles from before calibrate's check have none
        waited += ("Each calibration's check after its windows (the host's speed then against during them: GEMMs, "
                   "dispatch): " + ", ".join(
                       f"run {i + 1} {c['gemm_speed']:.2f} / {c['dispatch_speed']:.2f}"
                       + (" (a slow spell: one more window)" if c.get("again") else "") for i, c in checks) + ".\n\n")
    spells = [f"run {i + 1}: {note}" for i, run in enumerate(runs) if (note := spell_note(run["rows"]))]
    if spells:
        waited += "Flagged by the bench: " + "; ".join(spells) + ".\n\n"
    return (head + estimates_table(last["rows"]) + "\nMeasured / estimate in each run (in brackets: the host's "
            "speed during the case against its calibration's, the median of the probes before each sample; "
            "above 1: faster than when calibrated):\n\n" + runs_head + runs_rows + "\n\n" + waited + verdict + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--dir", type=Path, default=ROOT / "bench/out/estimates-runs")
    ap.add_argument("--from", dest="reuse", type=Path, help="render the runs already in this folder")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/bench")
    args = ap.parse_args(argv)
    runs = load(args.reuse, args.runs) if args.reuse else run(args.dir, args.runs, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "estimates.md").write_text(page(runs))
    (args.out / "estimates_results.json").write_text(json.dumps(
        {"estimates": runs[-1]["rows"], "profile": runs[-1]["profile"], "runs": [
            {k: r.get(k) for k in ("start", "end", "repeats", "rows", "profile")} for r in runs]}, indent=1) + "\n")
    print(f"wrote {args.out / 'estimates.md'}, {args.out / 'estimates_results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
