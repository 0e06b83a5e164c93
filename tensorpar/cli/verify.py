"""`tensorpar verify`: layer-by-layer comparison of the split and unsplit models."""
from __future__ import annotations

import json
import sys

from tensorpar.cli.progress import Phases, console, reporting_rank


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="compare the split and unsplit models layer by layer, forward and backward")
    p.add_argument("--model", metavar="DIR", required=True, help="a local Hugging Face checkpoint directory")
    p.add_argument("--tp", default="2", help="comma-separated tp sizes to check (default: 2), e.g. 2,4")
    p.add_argument("--dtype", default="float32", help="float32 (default), float64, bfloat16, float16")
    p.add_argument("--batch", type=int, default=2, help="sequences in the random batch (default 2)")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence (default 16)")
    p.add_argument("--backend", default="auto", help="auto (NCCL with a GPU per rank, else shared memory between local ranks), shm, gloo, nccl")
    p.add_argument("--inject-fault", type=int, metavar="BLOCK",
                   help="scale the last weight matrix of BLOCK on the last rank, to see a divergence being caught")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=main)


def _sizes(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--tp {text!r} must be comma-separated integers, e.g. 2,4") from None


def main(args) -> int:
    from tensorpar.jobs.verify import verify

    with Phases(quiet=args.json) as phase:
        report = verify(args.model, _sizes(args.tp), dtype=args.dtype, batch=args.batch, seq=args.seq,
                        backend=args.backend, inject_fault=args.inject_fault, phase=phase)
    if not reporting_rank():  # under torchrun every process holds the report: rank 0 prints it
        return 0 if report.ok else 1
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        _show(report)
    if not report.ok:
        bad = [f"tp={c.tp}: {c.first_divergence}" for c in report.checks if c.first_divergence]
        print(f"tensorpar verify: diverged at {'; '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _show(r) -> None:
    from rich.table import Table

    from tensorpar.jobs.verify import rounding_factor

    con = console()
    con.print(f"[bold]{r.model}[/] ({r.family}, {r.dtype}, batch {r.batch} x {r.seq} tokens)")
    for c in r.checks:
        below = r.dtype != "float64"  # the float64 structure check is a column of its own
        t = Table(title=f"tp={c.tp}: max |split - unsplit| / max |unsplit|, tolerance {c.tolerance_rel:g}; "
                        f"excess <= 1: within it, or within {rounding_factor(c.tp):g}x the unsplit model's own "
                        f"rounding error (against float64)"
                        + (f"; structure: the same shards in float64 against the float64 unsplit model, "
                           f"relative {c.structure_tolerance:g}"
                           + (" (the model computes part of its forward in float32 even in float64)"
                              if c.structure_tolerance > 1e-10 else "") if below else ""), title_justify="left")
        for col in ("layer", "activation", "d loss / d activation", "parameter gradients", "excess",
                    *(("structure",) if below else ()), ""):
            t.add_column(col, justify="right")
        for lay in c.layers:
            verdict = ("[green]ok[/]" if lay.ok else "[red]FIRST DIVERGENCE[/]" if lay.name == c.first_divergence
                       else "[yellow]downstream[/]")
            t.add_row(lay.name, f"{lay.activation_rel:.1e}", f"{lay.activation_grad_rel:.1e}",
                      f"{lay.param_grad_rel:.1e}", f"{lay.excess:.2g}",
                      *((f"{lay.structure:.2g}",) if below else ()), verdict)
        con.print(t)
        if c.routing:
            con.print(f"routing: {c.routing}")
        con.print(f"loss: split {c.loss_split:.8g}, unsplit {c.loss_dense:.8g}; "
                  + (f"[red]first divergence: {c.first_divergence}[/]" if c.first_divergence else "[green]all blocks agree[/]"))
