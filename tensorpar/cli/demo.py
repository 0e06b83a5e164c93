"""`tensorpar demo`: a transformer MLP split over simulated devices, equal to the unsplit one.

Prints the shapes each device holds, the comparison with the unsplit MLP, every collective with
the bytes each device sent, and the axis advice; ``--json`` prints the same as one JSON object.
Exit code 0 when the split result is within its rounding bound and the byte log matches the
ring formula, 1 otherwise.
"""
from __future__ import annotations

import json
import sys


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="transformer MLP split over simulated devices vs unsplit (numpy)",
        description="A transformer MLP split over p simulated devices (numpy), checked against the "
                    "unsplit MLP, with the bytes each device sends and the axis advice.")
    parser.add_argument("--p", type=int, default=4, help="number of simulated devices (default 4)")
    parser.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per sequence (default 16)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--ffn-mult", type=int, default=4, help="ffn = ffn_mult * hidden (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=main)


def main(args) -> int:
    from tensorpar.reference import run_mlp_demo  # numpy: loaded when the demo runs, not for --help

    result = run_mlp_demo(args.p, batch=args.batch, tokens=args.tokens, hidden=args.hidden,
                          ffn_mult=args.ffn_mult, seed=args.seed)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(render(result))
    ok = result.equal and result.log_matches_formula
    if not ok:
        sys.stderr.write("tensorpar demo: the split MLP does not match the unsplit one\n")
    return 0 if ok else 1


def render(r) -> str:
    """The demo result as readable text."""
    p = r.p
    lines = [
        f"MLP  relu(X W1 + b1) W2 + b2  split over p={p} simulated devices ({r.dtype}, seed {r.seed})",
        f"  X  {_shape(r.x_shape)}  replicated on every device",
        f"  W1 {_shape(r.w1_shape)}  split by columns -> {_shape(r.w1_shard_shape)} per device",
        f"  W2 {_shape(r.w2_shape)}  split by rows    -> {_shape(r.w2_shard_shape)} per device",
        f"  weights: {r.weight_bytes:,} bytes in all, {r.weight_bytes_per_device:,} per device",
        f"split == unsplit: {'yes' if r.equal else 'NO'}  "
        f"(max |diff| {r.max_abs_diff:.3g}, rounding bound {r.max_error_bound:.3g})",
        "communication (ring algorithm, bytes each device sends):",
    ]
    for c in r.collectives:
        lines.append(f"  {c.op} of {_shape(c.shape)} {c.dtype}, N = {c.payload_bytes:,} bytes: "
                     f"{', '.join(f'{b:,}' for b in c.bytes_sent)}")
    lines.append(f"  expected 2(p-1)/p * N = {r.expected_bytes_per_rank:,} per device: "
                 f"{'matches' if r.log_matches_formula else 'DOES NOT MATCH'}")
    lines += _render_advice(r.advice)
    return "\n".join(lines)


def _render_advice(advice) -> list[str]:
    lines = [f"axis advice (W1 split, W2 split): {advice.choice}",
             f"  {'option':<9} {'bytes sent/device':>17}  {'weights/device':>14}  collectives"]
    for o in advice.options:
        mark = "*" if o.axis == advice.choice else " "
        moves = " + ".join(f"{c.op} {c.tensor}{_shape(c.shape)}" for c in o.collectives) or "none"
        sent = f"{o.bytes_sent_per_rank:,}" if o.feasible else "infeasible"
        lines.append(f"  {o.axis + mark:<9} {sent:>17}  {o.weight_bytes_per_device:>14,}  "
                     f"{moves if o.feasible else o.reason}")
    return lines


def _shape(shape) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"
