"""`tensorpar plan --model DIR` for any architecture: the plan read from tensorpar's own split of the
model (its inventory, built on the meta device for every rank), and on a dp x tp mesh the
training step of :mod:`tensorpar.planner.mesh`. The formula path and the shared renderers are in
:mod:`tensorpar.cli.plan`."""
from __future__ import annotations

import json

from tensorpar import planner as P
from tensorpar.cli.plan import SHAPES, _bytes, _s, _table, build_hardware

_FORMULA_ONLY = (("pp", 1, "--pp"), ("dp", 1, "--dp"), ("search", False, "--search"),
                 ("sequence_parallel", False, "--sequence-parallel"), ("recompute", "none", "--recompute"),
                 ("zero_stage", 0, "--zero-stage"), ("global_batch", None, "--global-batch"), ("plot", None, "--plot"),
                 ("devices", None, "--devices"), ("kv_tokens", None, "--kv-tokens"))


def _config_file(model: str | None):
    from pathlib import Path
    if not model:
        return None
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    return path if path.is_file() and path.name.endswith(".json") else None


def uses_inventory(args) -> bool:
    """``--model`` is a config the formulas do not count (or ``--inventory``): plan it from its
    inventory. Presets and the formula families keep the formula path. A config that makes no
    model (not an object, a size zero or negative, here or nested) is refused on either path."""
    path = _config_file(args.model)
    if path is None:
        if args.inventory:
            raise ValueError(f"--inventory needs --model DIR or a config.json; got {args.model!r}")
        return False
    P.hfconfig.read_config(path)  # ValueError naming the file and the field
    if args.inventory:
        return True
    try:
        P.from_hf_config(path)
    except P.hfconfig.NotModelled:  # only a type the formulas do not count: any other error is the config's
        return True
    return False


def main_inventory(args) -> int:
    mesh = ("dp", "zero_stage", "sequence_parallel") if args.workload == "train" else ()  # planned on a mesh
    given = [flag for attr, default, flag in _FORMULA_ONLY if getattr(args, attr) != default and attr not in mesh]
    given += [f"--{k.replace('_', '-')}" for k in SHAPES if getattr(args, k) is not None and k != "seq"]
    if given:
        raise ValueError(f"{', '.join(given)}: planned by the formula path only (presets, or --model of "
                         f"{', '.join(P.hfconfig.SUPPORTED)}); a plan from tensorpar's own split covers tp alone")
    from tensorpar.cli.progress import Phases

    _check_counts(args)
    path = _config_file(args.model)
    with Phases(quiet=args.json) as phase, phase(f"meta-device model, its split for each of {args.tp} ranks"):
        inv = _inventory(path, args.tp)
    seq = args.seq if args.seq is not None else _max_positions(path)
    workload = "train" if args.workload == "train" else "inference"
    report = P.plan_inventory(inv, build_hardware(args), batch=args.micro_batch * args.dp, seq=seq,
                              dtype=args.dtype, workload=workload, dp=args.dp, zero_stage=args.zero_stage,
                              sequence_parallel=args.sequence_parallel)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        _render_inventory(report)
    return 0 if report.feasible else 1


def _check_counts(args) -> None:
    """The counts the inventory path reads, each a positive integer (``--seq 0`` would otherwise
    fall back to the config's positions; ``--dp 0`` be named as a batch of 0)."""
    for flag, value in (("--tp", args.tp), ("--dp", args.dp), ("--micro-batch", args.micro_batch),
                        ("--seq", args.seq)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} ({value}) must be a positive integer")


# What transformers raises for a config.json its configuration class refuses (a validator's
# error, a size that divides by zero), and what building a model tensorpar cannot plan raises
# (a vision or audio model missing what a text model has): named, in one line.
_BUILD_ERRORS = (TypeError, AttributeError, KeyError, IndexError, ZeroDivisionError, RuntimeError,
                 NotImplementedError, AssertionError)


def _inventory(path, tp: int):
    from huggingface_hub.errors import StrictDataclassError

    from tensorpar.sharding.inventory import build_inventory

    kind = P.hfconfig.read_config(path).get("model_type")
    try:
        return build_inventory(path, tp, head=True)
    except StrictDataclassError as exc:  # a validator of the configuration class: its own words
        cause = exc.__cause__ or exc
        raise ValueError(f"{path}: transformers refuses this {kind} config: {_words(cause)}") from None
    except _BUILD_ERRORS as exc:
        raise ValueError(f"{path}: tensorpar cannot build and split this {kind} model for a plan "
                         f"({type(exc).__name__}: {_words(exc)})") from None


def _words(exc) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _max_positions(path) -> int:
    """The model's position limit, from its config or the text model's nested in it; 2048 when none is given."""
    for cfg in P.hfconfig.text_configs(P.hfconfig.read_config(path)):
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return cfg[key]
    return 2048


def _render_inventory(r) -> None:
    from tensorpar.cli.progress import console as make_console

    console = make_console(highlight=False)
    m = r.model
    console.print(f"[bold]{m['name']}[/] ({m['model_type']}, {m['model_class']}, plan: {m['plan_source']}) on "
                  f"[bold]{r.hardware['name']}[/]: tp={r.tp}, {r.workload}, {r.dtype}, batch {r.batch}, seq {r.seq}")
    console.print("[green]fits[/]" if r.feasible else "[bold red]does NOT fit[/]")
    for line in r.reasons:
        console.print(f"  [red]x[/] {line}")
    for fix in r.fixes:
        console.print(f"  [yellow]fix[/] {fix}")
    for block, why in r.whole.items():
        console.print(f"  [yellow]whole[/] {block}: {why}")
    t = _table("model and split", "", "value")
    t.add_row("parameters / per rank", f"{r.params:,} / {', '.join(f'{n:,}' for n in r.params_per_rank)}")
    t.add_row("valid tp sizes", ", ".join(map(str, r.valid_tp_sizes)))
    t.add_row(f"forward FLOPs per token (context {r.seq}) / per rank",
              f"{r.flops['forward_per_token']:.4g} / {max(r.flops['forward_per_token_per_rank']):.4g}")
    kv = r.kv_cache
    t.add_row("KV cache per token (unsplit / per rank)",
              f"{_bytes(kv['bytes_per_token'])} / {_bytes(max(kv['bytes_per_token_per_rank']))}"
              + (f", {kv['windowed_layers']} of {kv['cached_layers']} layers windowed" if kv["windowed_layers"] else ""))
    console.print(t)
    mem = r.memory_per_device
    t = _table("memory per device", "part", "bytes")
    for part in ("weights", "gradients", "optimizer", "kv_cache", "activations", "total"):
        t.add_row(part, "not counted" if mem[part] is None else _bytes(mem[part]))
    t.add_row("capacity", _bytes(r.hardware["mem_bytes"]))
    console.print(t)
    mesh = r.comm.get("mesh_step")
    if mesh is not None:
        how = f"dp={mesh['dp']} ({mesh['data_parallel']}) x tp={mesh['tp']}" + (
            ", sequence parallel" if mesh["sequence_parallel"] else "")
        for part in ("tp", "dp"):
            items = mesh[f"{part}_items"]
            total = sum(i["total_bytes_sent_per_rank"][0] for i in items)
            console.print(_prediction_table({"items": items, "bytes_sent_per_rank": [total]},
                                            f"{part} collectives per training step on {how}, rank 0"))
    for key, title in (("step", "per step"), ("decode_step", "per decode step")):
        if r.comm[key] is not None and not (mesh is not None and key == "step"):
            console.print(_prediction_table(r.comm[key], f"collectives {title} ({r.comm[key]['workload']}), rank 0"))
    t = _table("time: lower bounds", "bound", "lower bound")
    for key, value in r.bounds.items():
        if key.endswith("_s"):
            t.add_row(key.removesuffix("_s").replace("_", " "), _s(value))
    console.print(t)
    for note in r.notes:
        console.print(f"- {note}")


def _prediction_table(pred: dict, title: str):
    t = _table(title, "op", "where", "phase", "payload N", "sent/rank", "count", "total sent")
    for i in pred["items"]:
        t.add_row(i["op"], i["where"], i["phase"], _bytes(i["payload_bytes"]), _bytes(i["bytes_sent_per_rank"][0]),
                  str(i["count"]), _bytes(i["total_bytes_sent_per_rank"][0]))
    t.add_row("", "[bold]total[/]", "", "", "", "", _bytes(pred["bytes_sent_per_rank"][0]))
    return t
