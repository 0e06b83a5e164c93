"""`tensorpar calibrate`: measure this machine into a hardware profile for `tensorpar plan --hardware FILE`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tensorpar.cli import progress


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine (GEMMs, memory, a block's fixed cost, collectives) "
                       "into a hardware profile for the planner's estimates")
    p.add_argument("--ranks", type=int, default=2, help="processes measured at once, one thread each (default 2)")
    p.add_argument("--out", metavar="FILE", default="bench/out/profile.json",
                   help="where to write the profile (JSON; default bench/out/profile.json)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and payloads (a smoke run, a few seconds)")
    p.add_argument("--repeats", type=int, default=5, help="samples per figure (default 5): a rate's and a collective's median kept, a fixed cost's least")
    p.add_argument("--json", action="store_true", help="print the profile as one JSON object")
    p.set_defaults(func=main)


def main(args) -> int:
    from tensorpar.bench.calibrate import calibrate

    if args.repeats < 3:
        raise ValueError(f"--repeats {args.repeats}: need at least 3 samples for a median")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with progress.Phases(quiet=args.json) as phase:
        with phase(f"measuring this machine on {args.ranks} ranks"):
            profile = calibrate(args.ranks, quick=args.quick, repeats=args.repeats)
    profile.save(out)
    if args.json:
        print(json.dumps(profile.to_dict()))
        return 0
    print(summary(profile))
    print(f"wrote: {out}  (use it: tensorpar plan --hardware {out} ...)", file=sys.stderr)
    return 0


def summary(profile) -> str:
    """The profile in a few lines: each figure and its fit's error."""
    lines = [f"# {profile.name} ({profile.measured.get('seconds', '?')} s)", ""]
    for dtype, g in profile.gemm.items():
        lines.append(f"- GEMM {dtype}: {g.rate_flops / 1e9:.1f} GFLOP/s, operands at {g.bytes_per_s / 1e9:.1f} GB/s, "
                     f"{g.fixed_s * 1e6:.1f} us per call (fit: median {g.fit.get('median_rel_err', 0):.0%}, "
                     f"worst {g.fit.get('max_rel_err', 0):.0%} off)")
    lines.append(f"- memory: {profile.memory_bytes_per_s / 1e9:.1f} GB/s (read + written)")
    if profile.optimizer_s_per_param:
        lines.append(f"- an optimizer step (clipping, AdamW): {profile.optimizer_s_per_param * 1e9:.2f} ns per parameter")
    if windows := profile.measured.get("by_window"):
        lines.append("- by window (start, middle, end, and the check's where it found a spell; the profile keeps the rates' median, the fixed costs' least "
                     "over every round, and alpha from more moments): " + "; ".join(
            f"{name} " + " / ".join(f"{w[part][key] * scale:.{digits}f}" if key in w.get(part, {}) else "-" for w in windows)
            + unit for name, part, key, scale, digits, unit in (
                ("decode block", "block_s", "decode", 1e6, 0, " us"), ("train block", "block_s", "train", 1e6, 0, " us"),
                ("shm alpha", "alpha_s", "shm", 1e6, 0, " us"), ("gloo alpha", "alpha_s", "gloo", 1e3, 2, " ms"))
            if any(key in w.get(part, {}) for w in windows)))
    if check := profile.measured.get("check"):
        lines.append(f"- the check after the windows: the host ran {check['gemm_speed']:.2f}x (GEMMs) and "
                     f"{check['dispatch_speed']:.2f}x (a block's dispatch) as fast as during them"
                     + ("; a slow spell: one more window measured" if check.get("again") else ""))
    for phase, s in profile.block_call_s.items():
        lines.append(f"- a block's fixed cost, {phase}: {s * 1e6:.0f} us (per step: "
                     f"{profile.step_call_s.get(phase, 0.0) * 1e6:.0f} us)")
    for name, link in profile.links.items():
        for op, table in link.ops.items():
            for p, fit in table.items():
                f = fit.get("fit", {})
                lines.append(f"- {name} {op} over {p} ranks: alpha {fit['alpha_s'] * 1e6:.1f} us, "
                             f"{1 / fit['beta_s_per_byte'] / 1e9 if fit['beta_s_per_byte'] else float('inf'):.2f} GB/s "
                             f"(fit: median {f.get('median_rel_err', 0):.0%}, worst {f.get('max_rel_err', 0):.0%} off)")
    for name, by_size in profile.collective_wait.items():
        for p, wait in by_size.items():
            lines.append(f"- {name}: the wait at a collective of {p} ranks for the slower rank: " + ", ".join(
                f"{w * 1e6:.0f} us after {seg * 1e3:.2f} ms of work" for seg, w in wait["points"]))
    return "\n".join(lines)
