"""`tensorpar plan`: memory, communication and time bounds of a layout, or a search over layouts.

``--json`` prints one JSON object (a :class:`tensorpar.planner.PlanReport`, or a
:class:`~tensorpar.planner.SearchResult` with ``--search``); without it, tables (rich). ``--plot
PATH`` writes a PNG of memory per device and communication per step against tp. Bad input raises
``ValueError`` in the planner; the dispatcher prints it as one line and exits 2. A layout that
does not fit (or a search that finds none) exits 1, like a failed proof.

One path for every model: a preset or ``--family`` shapes go through their template
(``tensorpar.architecture.templates``), ``--model DIR`` or a ``config.json`` of any architecture
``parallelize`` splits through the meta-device producer (``tensorpar.sharding.inventory.MetaSource``:
the plan ``parallelize`` would apply, built for every rank at each tp the plan or search asks for);
:func:`tensorpar.planner.plan` and :func:`~tensorpar.planner.search` read the split model either
hands over. ``--inventory`` is kept for compatibility: a config is always planned that way.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tensorpar import planner
from tensorpar import plots
from tensorpar.cli import progress
from tensorpar.planner import hfconfig
from tensorpar.architecture.pipeline import SCHEDULES
from tensorpar.planner.layout import DTYPE_BYTES, OPTIMIZERS, RECOMPUTE, WORKLOADS, ZERO_STAGES
from tensorpar.planner.profile import hardware_or_profile, published, with_latency
from tensorpar.planner.search import tp_sweep
from tensorpar.planner.tp_search import search_tp
from tensorpar.cli.plan_render import _bytes, _s, _table, print_result

SHAPES = ("family", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "head_dim")
REQUIRED = ("family", "layers", "hidden", "heads", "vocab", "seq")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="memory, communication and time bounds of a tp x pp x dp layout",
        description="Plan a tensor-parallel layout before running it: parameters, FLOPs, memory per "
                    "device, every collective, lower bounds on step / decode / prefill time, "
                    "feasibility with fixes; or --search over tp x pp x dp.")
    m = p.add_argument_group("model (a preset or config.json, or the shapes)")
    m.add_argument("--model", help=f"preset ({', '.join(planner.MODEL_PRESETS)}) or a Hugging Face config.json")
    m.add_argument("--family", choices=("gpt", "llama"))
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "seq", "head-dim"):
        m.add_argument(f"--{name}", type=int)
    lay = p.add_argument_group("layout")
    for name, default in (("tp", 1), ("pp", 1), ("dp", 1), ("micro-batch", 1)):
        lay.add_argument(f"--{name}", type=int, default=default, help=f"default {default}")
    lay.add_argument("--global-batch", type=int, help="sequences per step (default micro-batch x dp x microbatches)")
    lay.add_argument("--schedule", default="1F1B", help=f"pipeline schedule, PyTorch's: {', '.join(SCHEDULES)} "
                     "(default 1F1B)")
    lay.add_argument("--microbatches", type=int, help="microbatches per step and dp rank (sets the global batch to "
                     "micro-batch x dp x M; default 1, or global batch / (micro-batch x dp))")
    lay.add_argument("--virtual-stages", type=int, help="stages per pipeline rank (default 1; 2 for the "
                     "interleaved and V schedules)")
    lay.add_argument("--sequence-parallel", action="store_true")
    lay.add_argument("--recompute", choices=RECOMPUTE, default="none")
    lay.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="bf16")
    lay.add_argument("--zero-stage", type=int, choices=ZERO_STAGES, default=0,
                     help="ZeRO stage over dp (default 0; 0 is DDP's buckets, 3 FSDP2's units)")
    lay.add_argument("--optimizer", choices=OPTIMIZERS, default="adam-mixed",
                     help="Adam's state per parameter: adam-mixed (fp32 master + moments, 16 B at 16-bit; "
                          "default) or adamw (moments in the model dtype, as tensorpar train keeps them)")
    lay.add_argument("--workload", choices=WORKLOADS, default="train")
    hw = p.add_argument_group("hardware (a preset, optionally overridden)")
    hw.add_argument("--hardware", default="a100-80gb", help=f"preset ({', '.join(planner.HARDWARE_PRESETS)}; estimates "
                    "from public figures) or a profile FILE written by tensorpar calibrate (estimates from this "
                    "machine's measured rates)")
    hw.add_argument("--peak-tflops", type=float, help="dense bf16 peak, TFLOP/s")
    hw.add_argument("--hbm-gbps", type=float, help="HBM bandwidth, GB/s")
    hw.add_argument("--memory-gb", type=float, help="device memory, GB")
    hw.add_argument("--intra-node-gbps", type=float, help="intra-node link, GB/s per direction")
    hw.add_argument("--inter-node-gbps", type=float, help="inter-node link per device, GB/s per direction")
    hw.add_argument("--intra-node-link", help="which of the preset's links joins a node (nvlink, pcie)")
    hw.add_argument("--devices-per-node", type=int)
    o = p.add_argument_group("search and output")
    o.add_argument("--search", action="store_true", help="rank every tp x pp x dp of --devices by its estimated time")
    o.add_argument("--devices", type=int, help="device count (required with --search; checked against tp x pp x dp)")
    o.add_argument("--kv-link", default="inter-node", help="link for the KV transfer time: inter-node, "
                   "intra-node, a preset link name, or GB/s (default inter-node)")
    o.add_argument("--kv-tokens", type=int, help="tokens of KV cache to transfer (default micro-batch x seq)")
    o.add_argument("--search-tp", action="store_true",
                   help="inference: decode latency, tokens/s and prefill at every valid tp up to --max-tp, and where "
                        "adding ranks stops paying (collective latency against the work each rank saves)")
    o.add_argument("--max-tp", type=int, help="largest tp --search-tp tries (default: the devices of one node)")
    o.add_argument("--collective-latency-us", type=float, default=None,
                   help="latency per collective in the estimates, never in the bounds (default: the hardware "
                        "profile's own: 10 us in a node and 20 us across nodes for a preset, measured for a FILE)")
    o.add_argument("--plot", metavar="PATH", help="write a PNG of memory and communication against tp")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--inventory", action="store_true",
                   help="kept for compatibility: a config.json or checkpoint directory is always planned from "
                        "tensorpar's own split of it (any architecture parallelize splits)")
    p.set_defaults(func=main)


def config_file(model: str | None) -> Path | None:
    """``--model`` as a config file: a ``.json`` file, or a directory holding ``config.json``."""
    if not model:
        return None
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    return path if path.is_file() and path.name.endswith(".json") else None


def model_source(args):
    """What the plan reads: a config through the meta-device producer (torch and transformers
    load here, only for a config), else the preset or shapes through their template."""
    path = config_file(args.model)
    if path is None:
        if args.inventory:
            raise ValueError(f"--inventory needs --model DIR or a config.json; got {args.model!r}")
        return planner.TemplateSource(build_model(args))
    shapes = [f"--{k.replace('_', '-')}" for k in SHAPES if getattr(args, k) is not None and k != "seq"]
    if shapes:
        raise ValueError(f"{', '.join(shapes)}: shape options describe a preset or --family model; "
                         f"{path.name} is planned as written (edit it to change a size)")
    hfconfig.read_config(path)  # ValueError naming the file and the field, before torch loads
    _check_counts(args)
    from tensorpar.sharding.inventory import MetaSource

    return MetaSource(path, seq=args.seq)


def _check_counts(args) -> None:
    """``--seq`` of a config, a positive integer (0 would otherwise fall back to the config's
    positions); the layout's counts are checked by the layout."""
    if args.seq is not None and args.seq < 1:
        raise ValueError(f"--seq ({args.seq}) must be a positive integer")


def build_model(args) -> planner.ModelSpec:
    """The model from a preset ``--model`` (shape options override it) or from the shape options alone."""
    given = {k: getattr(args, k) for k in SHAPES if getattr(args, k) is not None}
    if "seq" in given:
        given["seq_source"] = "--seq"
    if args.model:
        base = planner.get_model(args.model).to_dict()
        if "hidden" in given or "heads" in given:
            base["head_dim"] = given.get("head_dim")  # re-derived unless given
        if "layers" in given and base["window_layers"] == base["layers"]:
            base["window_layers"] = None  # a window in every layer stays in every layer
        return planner.ModelSpec(**{**base, **given})
    missing = [f"--{k.replace('_', '-')}" for k in REQUIRED if k not in given]
    if missing:
        raise ValueError(f"give --model (one of: {', '.join(planner.MODEL_PRESETS)}, or a config.json) "
                         f"or the shapes; missing: {', '.join(missing)}")
    return planner.ModelSpec(**given)


_HW_FLAGS = (("peak_tflops", "--peak-tflops"), ("hbm_gbps", "--hbm-gbps"), ("memory_gb", "--memory-gb"),
             ("intra_node_gbps", "--intra-node-gbps"), ("inter_node_gbps", "--inter-node-gbps"))


def check_hardware_flags(args) -> None:
    """Each hardware figure typed on the command line is a positive finite number (named by its flag)."""
    for attr, flag in _HW_FLAGS:
        value = getattr(args, attr)
        if value is not None and not 0 < value < math.inf:
            raise ValueError(f"{flag} ({value:g}) must be a positive finite number")
    if args.devices_per_node is not None and args.devices_per_node < 1:
        raise ValueError(f"--devices-per-node ({args.devices_per_node}) must be a positive integer")


def build_hardware(args) -> planner.Hardware:
    """The hardware of the bounds; ``args.profile`` becomes the estimates' profile (a calibrated
    FILE's, else None: the preset's published figures)."""
    check_hardware_flags(args)
    base, args.profile = _hardware_or_profile(args.hardware)
    if args.intra_node_link is not None and args.intra_node_link not in base.links:
        raise ValueError(f"--intra-node-link ({args.intra_node_link!r}) must be one of {base.name}'s links: "
                         f"{', '.join(base.links)}")
    g = 1e9
    return base.with_overrides(
        peak_dense_bf16_flops=None if args.peak_tflops is None else args.peak_tflops * 1e12,
        peak_dense_tf32_flops=None if args.peak_tflops is None else args.peak_tflops * 1e12,
        hbm_bytes_per_s=None if args.hbm_gbps is None else args.hbm_gbps * g,
        mem_bytes=None if args.memory_gb is None else args.memory_gb * g,
        intra_node_bytes_per_s=None if args.intra_node_gbps is None else args.intra_node_gbps * g,
        inter_node_bytes_per_s=None if args.inter_node_gbps is None else args.inter_node_gbps * g,
        intra_node_link=args.intra_node_link, devices_per_node=args.devices_per_node)


def _hardware_or_profile(text: str):
    """A preset (its estimates from public figures: None here) or a profile file (its own)."""
    hw, prof = hardware_or_profile(text)
    return hw, prof if (text.endswith(".json") or Path(text).is_file()) else None


def layout_options(args) -> dict:
    return {"sequence_parallel": args.sequence_parallel, "recompute": args.recompute, "dtype": args.dtype,
            "zero_stage": args.zero_stage, "optimizer": args.optimizer, "schedule": args.schedule,
            "virtual_stages": args.virtual_stages}


def global_batch(args, dp: int) -> int | None:
    """``--global-batch``, or micro-batch x dp x ``--microbatches``; both given must agree."""
    m = args.microbatches
    if m is None:
        return args.global_batch
    if isinstance(m, bool) or m < 1:
        raise ValueError(f"--microbatches ({m}) must be a positive integer")
    implied = args.micro_batch * dp * m
    if args.global_batch is not None and args.global_batch != implied:
        raise ValueError(f"--global-batch ({args.global_batch}) and --microbatches ({m}) disagree: micro-batch x dp x "
                         f"microbatches = {args.micro_batch} x {dp} x {m} = {implied}; give one of them")
    return implied


def kv_link(value: str):
    """A link name, or GB/s (a positive finite number)."""
    try:
        gbps = float(value)
    except ValueError:
        return value
    if not 0 < gbps < math.inf:
        raise ValueError(f"--kv-link ({value}) must be a positive finite GB/s or a link name: inter-node, "
                         "intra-node, or one of the hardware's links")
    return gbps * 1e9


def latency_s(args) -> float | None:
    us = args.collective_latency_us
    if us is None:
        return None
    if not 0 <= us < math.inf:
        raise ValueError(f"--collective-latency-us ({us:g}) must be a finite number >= 0")
    return us * 1e-6


def main(args) -> int:
    hardware = build_hardware(args)
    if args.search and args.devices is None:
        raise ValueError("--search needs --devices N (the number of devices to lay out)")
    if args.search and args.microbatches is not None:
        raise ValueError("--microbatches depends on each layout's dp; with --search give --global-batch (the "
                         "same for every layout)")
    if args.search and args.search_tp:
        raise ValueError("--search and --search-tp: choose one (--search lays out devices, --search-tp sweeps tp "
                         "for inference)")
    if args.search_tp and args.workload != "inference":
        raise ValueError(f"--search-tp estimates decoding: it needs --workload inference, not {args.workload!r}")
    layout = None if (args.search or args.search_tp) else _layout(args)
    model = model_source(args)
    if args.search_tp:
        return _search_tp(args, model, hardware)
    with progress.Phases(quiet=args.json) as phase:
        if args.search:
            with phase(f"searching tp x pp x dp over {args.devices} devices"):
                result = run_search(args, model, hardware)
        else:
            with phase(f"planning tp={layout.tp} pp={layout.pp} dp={layout.dp}"):
                result = planner.plan(model, layout, hardware, kv_link=kv_link(args.kv_link), kv_tokens=args.kv_tokens,
                                      latency_s=latency_s(args), profile=args.profile)
    if args.plot:
        _plot(args, model, hardware, result)
    if isinstance(result, planner.SearchResult):
        result.command = train_command(args, result.best)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print_result(result)
    return 0 if _feasible(result) else 1


def _search_tp(args, model, hardware) -> int:
    if args.max_tp is not None and args.max_tp < 1:
        raise ValueError(f"--max-tp ({args.max_tp}) must be a positive integer")
    profile = args.profile
    if args.collective_latency_us is not None:
        profile = with_latency(profile or published(hardware), latency_s(args))
    result = search_tp(model, hardware, profile=profile, micro_batch=args.micro_batch, seq=args.seq,
                       dtype=args.dtype, max_tp=args.max_tp)
    _measured_point(args, result)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        console = progress.console(highlight=False)
        t = _table(f"decode at each tp on {result.hardware} (estimates from {result.profile}), batch "
                   f"{result.micro_batch}, context {result.context}", "tp", "fits", "decode/token", "tokens/s",
                   "lower bound", "work", "collectives", "prefill", "memory/device", "measured here")
        for r in result.rows:
            t.add_row(str(r["tp"]), "yes" if r["feasible"] else "[red]no[/]", _s(r["decode_time_per_token_s"]),
                      f"{r['decode_tokens_per_s']:,.0f}" if r["decode_tokens_per_s"] else "", _s(r["decode_lower_bound_s"]),
                      _s(r["work_s"]), _s(r["collectives_s"]), _s(r["prefill_time_s"]),
                      _bytes(r["memory_per_device_bytes"]) if r["memory_per_device_bytes"] else "",
                      _s(r.get("measured_decode_time_per_token_s")))
        console.print(t)
        for line in result.explanation:
            console.print(f"- {line}")
    return 0 if result.best is not None else 1


def _measured_point(args, result) -> None:
    """With a calibrated profile and a checkpoint folder: each tp that fits this machine's ranks
    decoded here, its time per token beside the estimate (``measured_decode_time_per_token_s``)."""
    path = config_file(args.model)
    if args.profile is None or path is None or not any(path.parent.glob("*.safetensors")):
        return None
    from tensorpar.bench.estimates import measure_decode

    ranks = int(args.profile.measured.get("ranks", 1))
    tps = [r["tp"] for r in result.rows if r["tp"] <= ranks and r["feasible"]]
    if not tps:
        return None
    measured = measure_decode(path.parent, tps, args.micro_batch, result.context)
    for r in result.rows:
        if r["tp"] in measured:
            r["measured_decode_time_per_token_s"] = measured[r["tp"]]
            r["measured_vs_estimate"] = measured[r["tp"]] / r["decode_time_per_token_s"]
    result.explanation.append("Measured here (" + ", ".join(
        f"tp={tp}: {measured[tp] * 1e3:.3f} ms, {measured[tp] / next(r for r in result.rows if r['tp'] == tp)['decode_time_per_token_s']:.2f}x the estimate"
        for tp in sorted(measured)) + ").")
    return None


def _layout(args) -> planner.Layout:
    """The layout asked for, checked against ``--devices`` when given."""
    layout = planner.Layout(tp=args.tp, pp=args.pp, dp=args.dp, micro_batch=args.micro_batch,
                            global_batch=global_batch(args, args.dp), workload=args.workload, **layout_options(args))
    if args.devices is not None and args.devices != layout.devices:
        raise ValueError(f"tp x pp x dp ({args.tp} x {args.pp} x {args.dp} = {layout.devices}) must equal "
                         f"--devices ({args.devices}); valid: layouts whose product is {args.devices} "
                         "(or use --search)")
    return layout


TRAIN_DTYPES = {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16"}  # tensorpar train --dtype


def train_command(args, best: dict | None) -> str | None:
    """The ``tensorpar train`` command line that runs the search's best layout (None without one).
    ``train --model`` takes a checkpoint directory: a preset or shapes leave ``DIR`` to fill in."""
    if best is None or args.workload != "train":
        return None
    path = config_file(args.model)
    model = str(path.parent) if path is not None else "DIR"
    gb = args.global_batch or args.micro_batch * args.devices
    m = gb // (args.micro_batch * best["dp"])
    words = ["tensorpar", "train", "--model", model, "--tp", best["tp"], "--pp", best["pp"], "--dp", best["dp"],
             "--schedule", planner.Layout(schedule=args.schedule).schedule, "--microbatches", m, "--batch", gb]
    if args.virtual_stages is not None:
        words += ["--virtual-stages", args.virtual_stages]
    if args.seq is not None:
        words += ["--seq", args.seq]
    words += ["--zero", 3] if args.zero_stage == 3 else []
    words += ["--sequence-parallel"] if args.sequence_parallel else []
    words += ["--dtype", TRAIN_DTYPES[args.dtype]] if args.dtype in TRAIN_DTYPES else []
    return " ".join(map(str, words))


def _feasible(result) -> bool:
    """Exit code 1 for a layout that does not fit (or a search that found none), like a failed proof."""
    return result.best is not None if isinstance(result, planner.SearchResult) else bool(result.feasible)


# ---- search and plot ---------------------------------------------------------------------------

def run_search(args, model, hardware) -> planner.SearchResult:
    return planner.search(model, hardware, devices=args.devices, micro_batch=args.micro_batch,
                          global_batch=args.global_batch, workload=args.workload, latency_s=latency_s(args),
                          profile=args.profile, **layout_options(args))


def _plot(args, model, hardware, result) -> None:
    if isinstance(result, planner.SearchResult):
        if result.best is None:
            raise ValueError("--plot needs a feasible layout; the search found none")
        best = result.best
        base = planner.Layout(tp=best["tp"], pp=best["pp"], dp=best["dp"], micro_batch=args.micro_batch,
                        global_batch=args.global_batch or args.micro_batch * args.devices,
                        workload=args.workload, **layout_options(args))
    else:
        base = planner.Layout(**{k: v for k, v in result.layout.items() if k not in ("devices", "num_micro_batches")})
    rows = tp_sweep(model, base, hardware)
    step = "per step" if base.workload == "train" else "per prefill of the global batch"
    plots.plot_tp_sweep(rows, args.plot, title=sweep_title(model, hardware, base, rows),
                  devices_per_node=hardware.devices_per_node, step=step)
    print(f"wrote {args.plot}", file=sys.stderr)  # stderr: --json keeps stdout to one object


def sweep_title(model, hardware, base, rows) -> str:
    """The plot's title; it says so when the sweep changes the device count (pp and dp held)."""
    title = f"{model.name} on {hardware.name}, pp={base.pp}, dp={base.dp}, micro-batch {base.micro_batch}"
    if len({r["devices"] for r in rows}) > 1:
        title += f"\ndevices (tp x pp x dp) grow with tp: {rows[0]['devices']} to {rows[-1]['devices']}"
    return title
