"""`tensorpar bench`: run the benchmark suite, write tables (markdown, JSON) and PNG plots."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tensorpar.bench import summary
from tensorpar.planner.profile import load
from tensorpar.cli.progress import Phases

SUITES = ("mlp", "models", "decode", "train", "pipeline", "serve", "estimates")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark tensorpar against its baselines (ratios, medians)")
    p.add_argument("--suite", default=",".join(SUITES),
                   help=f"comma-separated suites to run; valid: {', '.join(SUITES)} (default: all)")
    p.add_argument("--out", default="bench/out", help="folder for tables and plots (default: bench/out)")
    p.add_argument("--repeats", type=int, default=11, help="interleaved rounds per variant (default: 11; the two smallest "
                   "MLP sizes run 5x as many, shorter ones; a serve round runs every server on every load, about "
                   "a minute)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run of the chosen suites: the MLP suite at its two smallest sizes, the models "
                   "suite's three architectures at ~0.6M parameters and 2x32 tokens, the decode suite's Llama at "
                   "~0.6M parameters, batches 1 and 2, 8 tokens, the train suite's Llama at ~0.6M parameters, "
                   "4x32 tokens, 2 saves and loads, the pipeline suite's Llama at ~0.6M parameters, 4x32 tokens, the serve suite's Llama at hidden 128 and 2 layers, loads of 1 and 8 streams, "
                   "4-8 tokens a request")
    p.add_argument("--profile", metavar="FILE", default="bench/out/profile.json",
                   help="this machine's hardware profile for the estimates suite (written by tensorpar calibrate; "
                        "measured first when the file does not exist; default bench/out/profile.json)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(func=main)


def _suites(text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in chosen if s not in SUITES]
    if bad or not chosen:
        raise ValueError(f"--suite {text!r}: unknown {bad or 'empty'}; valid: {', '.join(SUITES)}")
    return chosen


def main(args) -> int:
    suites = _suites(args.suite)
    if args.repeats < 3:
        raise ValueError(f"--repeats {args.repeats}: need at least 3 rounds for a median")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with Phases(quiet=args.json) as phase:
        results, tables, files, warnings = _run(args, suites, out, phase)
    if args.json:
        print(json.dumps({"results": results, "files": [str(f) for f in files], "warnings": warnings}, default=float))
        return 0
    for name, table in tables.items():
        print(f"\n## {name}\n\n{table}")
    print("wrote: " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0


def _run(args, suites, out, phase):
    """Each suite chosen: ``(results, tables, files, warnings)``, ``warnings`` by suite (also on
    stderr and the suite's page)."""
    results, tables, files, warnings = {}, {}, [], {}
    if "mlp" in suites:
        from tensorpar.bench.mlp import DEFAULT_SIZES, run_mlp_bench

        sizes = DEFAULT_SIZES[:2] if args.quick else DEFAULT_SIZES
        with phase(f"MLP suite: {len(sizes)} sizes x (fwd, fwd+bwd), tp=2"):
            rows = run_mlp_bench(sizes, args.repeats)
        results["mlp"], tables["mlp"] = rows, summary.mlp_table(rows)
        (out / "mlp.md").write_text(tables["mlp"])
        files += [out / "mlp.md", summary.plot_ratios(rows, out / "mlp.png", {
            "tensorpar_vs_torch_tp": "tensorpar / PyTorch TP", "tensorpar_vs_floor": "tensorpar / floor",
            "tensorpar_vs_dense_2t": "tensorpar / dense (2 threads)"}, "TP MLP, tp=2")]
    if "models" in suites:
        from tensorpar.bench.models import QUICK, run_models_bench

        with phase("models suite: against HF tp_plan and unsplit, tp=2"):
            rows = run_models_bench(args.repeats, **(QUICK if args.quick else {}))
        results["models"], tables["models"] = rows, summary.models_table(rows)
        (out / "models.md").write_text(tables["models"])
        files += [out / "models.md", summary.plot_model_ratios(rows, out / "models.png", {
            "tensorpar_vs_hf_tp": "tensorpar / HF tp_plan=auto", "tensorpar_vs_dense_2t": "tensorpar / dense (2 threads)"},
            "models, tp=2")]
    if "decode" in suites:
        from tensorpar.bench.decode import QUICK as DECODE_QUICK
        from tensorpar.bench.decode import run_decode_bench

        with phase("decode suite: per token, shared memory / gloo / HF tp_plan / unsplit, tp=2"):
            rows = run_decode_bench(args.repeats, **(DECODE_QUICK if args.quick else {}))
        results["decode"], tables["decode"] = rows, summary.decode_table(rows)
        (out / "decode.md").write_text(tables["decode"])
        files.append(out / "decode.md")
    if "train" in suites:
        from tensorpar.bench.train import QUICK as TRAIN_QUICK
        from tensorpar.bench.train import run_train_bench

        with phase("train suite: a training step at dp 2 and tp 2 against FSDP2 and DTensor TP; checkpoints"):
            rows = run_train_bench(args.repeats, **(TRAIN_QUICK if args.quick else {}))
        results["train"], tables["train"] = rows, summary.train_table(rows)
        (out / "train.md").write_text(tables["train"])
        files.append(out / "train.md")
    if "pipeline" in suites:
        from tensorpar.bench.pipeline import QUICK as PIPELINE_QUICK
        from tensorpar.bench.pipeline import pipeline_page, pipeline_table, run_pipeline_bench

        with phase("pipeline suite: a training step at pp 2 (1F1B) against PyTorch's pipelining; bytes and bubble"):
            rows = run_pipeline_bench(args.repeats, **(PIPELINE_QUICK if args.quick else {}))
        results["pipeline"], tables["pipeline"] = rows, pipeline_table(rows)
        (out / "pipeline.md").write_text(pipeline_page(rows, _command("pipeline", args)))
        files.append(out / "pipeline.md")
    if "serve" in suites:
        from tensorpar.bench.serve import QUICK as SERVE_QUICK
        from tensorpar.bench.serve import run_serve_bench, serve_page, serve_table

        with phase(f"serve suite: tensorpar serve at tp 2 and HF continuous batching under open-loop load, "
                   f"{args.repeats} interleaved rounds"):
            rows = run_serve_bench(rounds=args.repeats, **(SERVE_QUICK if args.quick else {}))
        results["serve"], tables["serve"] = rows, serve_table(rows)
        (out / "serve.md").write_text(serve_page(rows, _command("serve", args)))
        files.append(out / "serve.md")
    if "estimates" in suites:
        from tensorpar.bench.calibrate import QUICK as CALIBRATE_QUICK
        from tensorpar.bench.estimates import QUICK as ESTIMATES_QUICK
        from tensorpar.bench.estimates import estimates_table, run_estimates_bench
        from tensorpar.bench.host_speed import spell_note

        given = Path(args.profile).is_file()
        profile = load(args.profile) if given else None
        source = args.profile if given else f"this launch's calibration (written to {args.profile})"
        with phase(f"estimates suite: training steps (tp 2, dp 2, pp 2), decode and prefill beside the planner's "
                   f"estimates from {source}"):
            rows, profile = run_estimates_bench(profile, args.repeats,
                                                calibration=CALIBRATE_QUICK if args.quick else None,
                                                **(ESTIMATES_QUICK if args.quick else {}))
        if not given:
            Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
            profile.save(args.profile)
        results["estimates"], tables["estimates"] = rows, estimates_table(rows)
        if note := spell_note(rows):
            print(f"warning: {note}", file=sys.stderr)
            warnings["estimates"] = note
        (out / "estimates.md").write_text(f"`{_command('estimates', args)}`, profile: {profile.name} "
                                          f"({profile.measured.get('at', '')})\n\n"
                                          + (f"Warning: {note}.\n\n" if note else "") + tables["estimates"])
        files.append(out / "estimates.md")
    files.append(summary.write_json(results, out / "results.json"))
    return results, tables, files, warnings


def _command(suite: str, args) -> str:
    """The command that reproduces one suite's figures (for its page)."""
    return f"tensorpar bench --suite {suite}" + (" --quick" if args.quick else "") + (
        f" --repeats {args.repeats}" if args.repeats != 11 else "")
