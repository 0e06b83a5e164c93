"""Search tp x pp x dp for a device count: reject the infeasible with reasons, rank the rest, explain.

Ranking: by the estimate (training: the step time; inference: the decode latency per token), the
time the planner expects (within 20% of every published run checked; this machine's runs beside
it: docs/bench/estimates.md); ties, and layouts without an estimate, by the lower bound. The bound is a floor,
loose by up to 4x, and the same for many layouts of one device count (their compute bound is
equal), so it cannot tell them apart; the explanation names the layout with the lowest bound when
the estimate ranks it lower. The rules the explanation states are Narayanan et al. 2021's (Sec.
3.3, "Takeaway #1-#2"): keep tensor parallelism within a node, where the links are fastest; use
pipeline parallelism across nodes; use data parallelism for the rest.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from .hardware import Hardware
from .layout import Layout, check_size
from .models import divisors
from .report import PlanReport, plan
from .source import source_of


@dataclass
class SearchResult:
    devices: int
    devices_per_node: int
    objective: str
    candidates: list = field(default_factory=list)
    best: dict | None = None
    explanation: list = field(default_factory=list)
    command: str | None = None  # the `tensorpar train` command of the best layout (set by the command line)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)


def search(model, hardware: Hardware, *, devices: int, micro_batch: int = 1,
           global_batch: int | None = None, workload: str = "train", latency_s: float | None = None,
           profile=None, **layout_options) -> SearchResult:
    """Every ``tp x pp x dp = devices`` layout of ``model`` (a ModelSpec or a model source),
    planned and ranked (feasible first).

    ``global_batch`` is fixed across layouts (default ``micro_batch x devices``) so that every
    layout does the same work; ``profile`` the estimates' rates (default: the hardware's published
    figures), ``latency_s`` their per-collective latency (never the bounds'); ``layout_options``
    are the other :class:`Layout` fields.
    """
    check_size("devices", devices)
    gb = micro_batch * devices if global_batch is None else global_batch
    Layout(micro_batch=micro_batch, global_batch=gb, workload=workload, **layout_options)  # validate once
    model = source_of(model)  # one source: each tp split once for all its layouts
    rows = [_candidate(model, hardware, tp, pp, devices // (tp * pp), micro_batch, gb, workload,
                       dict(latency_s=latency_s, profile=profile), layout_options)
            for tp in divisors(devices) for pp in divisors(devices // tp)]
    objective = "step_time" if workload == "train" else "decode_time_per_token"
    rows.sort(key=_rank)
    result = SearchResult(devices=devices, devices_per_node=hardware.devices_per_node, objective=objective,
                          candidates=rows)
    feasible = [r for r in rows if r["feasible"]]
    result.best = feasible[0] if feasible else None
    result.explanation = explain(result, hardware)
    return result


CLOSE = 0.01  # estimates this close are named as such: the model's error is far larger


def _rank(row: dict) -> tuple:
    """Feasible first, then by the estimate (the bound where a layout has none), the bound, tp, pp."""
    inf = float("inf")
    bound = row["bound_s"] if row["bound_s"] is not None else inf
    estimate = row["estimate_s"] if row["estimate_s"] is not None else bound
    return (not row["feasible"], estimate, bound, row["tp"], row["pp"])


def _candidate(model, hardware, tp, pp, dp, micro_batch, gb, workload, rates: dict, options) -> dict:
    row = {"tp": tp, "pp": pp, "dp": dp}
    try:
        layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, global_batch=gb, workload=workload, **options)
    except ValueError as exc:
        return {**row, "feasible": False, "reasons": [str(exc)], "bound_s": None, "estimate_s": None,
                "memory_per_device_bytes": None, "comm_bytes_per_device_per_step": None, "fixes": []}
    r = plan(model, layout, hardware, **rates)
    return {**row, **_summary(r, workload)}


def _summary(r: PlanReport, workload: str) -> dict:
    per_device = r.memory_per_device is not None
    if workload == "train":
        bound, estimate = r.step_time_lower_bound_s, (r.estimates or {}).get("step_time_s")
    else:
        bound, estimate = r.decode_time_per_token_lower_bound_s, (r.estimates or {}).get("decode_time_per_token_s")
    return {"feasible": r.feasible, "reasons": r.reasons, "fixes": [f["fix"] for f in r.fixes],
            "warnings": r.warnings, "bound_s": bound, "estimate_s": estimate,
            "memory_per_device_bytes": r.memory_per_device["total"] if per_device else None,
            "comm_bytes_per_device_per_step": r.comm["bytes_sent_per_device_per_step"]["total"] if per_device else None}


def explain(result: SearchResult, hardware: Hardware) -> list[str]:
    """The choice in plain words: what was picked, why, what was rejected, when tp > 1 loses."""
    best, rows = result.best, result.candidates
    if best is None:
        first = rows[0]["reasons"][0] if rows and rows[0]["reasons"] else "no layout"
        return [f"No layout of {result.devices} devices is feasible; for example tp={rows[0]['tp']}, "
                f"pp={rows[0]['pp']}, dp={rows[0]['dp']}: {first}"]
    feasible = [r for r in rows if r["feasible"]]
    lines = [_choice_line(best, feasible, result.objective, len(rows))]
    lines.append(_tp_node_line(best, feasible, hardware))
    rejected = [r for r in rows if not r["feasible"]]
    if rejected:
        smaller = [r for r in rejected if r["tp"] < best["tp"] and r["reasons"]]
        example = (smaller or rejected)[0]
        lines.append(f"{len(rejected)} layouts rejected, e.g. {_name(example)}: {example['reasons'][0]}")
    lines += _slower_than_one_device(rows, result.objective)
    return lines


def _name(row: dict) -> str:
    return f"tp={row['tp']}, pp={row['pp']}, dp={row['dp']}"


def _choice_line(best: dict, feasible: list[dict], objective: str, n_rows: int) -> str:
    what = "step time" if objective == "step_time" else "decode latency per token"
    line = (f"Choose {_name(best)}: lowest estimated {what}, {_ms(best['estimate_s'])} (lower bound "
            f"{_ms(best['bound_s'])}), among {len(feasible)} feasible of {n_rows} layouts")
    others = [r for r in feasible if r is not best]
    if others:
        line += f"; the runner-up, {_name(others[0])}, is estimated at {_ms(others[0]['estimate_s'])}"
        if others[0]["estimate_s"] is not None and others[0]["estimate_s"] <= best["estimate_s"] * (1 + CLOSE):
            line += f" (within {CLOSE:.0%}: the estimate does not separate them)"
    floor = min(feasible, key=lambda r: (r["bound_s"], r["tp"], r["pp"]))
    if floor is not best and floor["bound_s"] < best["bound_s"] * (1 - 1e-9):
        line += (f". {_name(floor)} has the lowest lower bound ({_ms(floor['bound_s'])}) but is estimated at "
                 f"{_ms(floor['estimate_s'])}: the bound counts no per-collective latency, no bubble and no "
                 f"fixed costs")
    return line + "."


def _tp_node_line(best: dict, feasible: list[dict], hw: Hardware) -> str:
    k, tp = hw.devices_per_node, best["tp"]
    if tp == 1:
        return "tp=1: the model fits without tensor parallelism, so no per-layer collectives are needed."
    if tp <= k:
        return (f"tp={tp} stays within a node ({k} devices), so every layer's collectives use "
                f"{hw.intra_node_link} at {hw.intra_node_bytes_per_s / 1e9:.0f} GB/s per direction rather than "
                f"the inter-node network at {hw.inter_node_bytes_per_s / 1e9:.0f} GB/s.")
    spans = (f"tp={tp} spans nodes ({k} devices per node): every layer's collectives cross the "
             f"{hw.inter_node_bytes_per_s / 1e9:.0f} GB/s network")
    inside = [r for r in feasible if r["tp"] <= k]
    if not inside:
        return spans + "; no layout with tp within a node fits."
    alt = inside[0]  # feasible rows are ranked, so this is the best within a node
    return (f"{spans}, and it is still estimated faster: {_ms(best['estimate_s'])} (lower bound "
            f"{_ms(best['bound_s'])}) against {_ms(alt['estimate_s'])} (lower bound {_ms(alt['bound_s'])}) for "
            f"the best layout with tp within a node, {_name(alt)}.")


def _slower_than_one_device(rows: list[dict], objective: str) -> list[str]:
    """Where tp > 1 is expected (by the estimate) to be slower than tp = 1 with the same pp."""
    base = {r["pp"]: r for r in rows if r["tp"] == 1 and r["feasible"] and r["estimate_s"] is not None}
    if not base:
        return ["tp=1 does not fit, so tensor parallelism is needed here (not only faster)."] if any(
            r["tp"] == 1 for r in rows) else []
    slower = [r for r in rows if r["tp"] > 1 and r["feasible"] and r["pp"] in base
              and r["estimate_s"] > base[r["pp"]]["estimate_s"]]
    if not slower:
        return []
    unit = "per step" if objective == "step_time" else "per token"
    return ["Expected slower than tp=1 with the same pp (the latency and ring traffic of their collectives "
            f"outweigh the work they split; {unit}): " + ", ".join(
                f"tp={r['tp']} pp={r['pp']} dp={r['dp']} ({_ms(r['estimate_s'])} vs "
                f"{_ms(base[r['pp']]['estimate_s'])})" for r in slower) + "."]


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds:.3f} s" if seconds >= 1 else f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def tp_sweep(model, layout: Layout, hardware: Hardware) -> list[dict]:
    """Memory per device and communication per step for every valid tp, the rest of ``layout``
    unchanged, so the device count ``tp x pp x dp`` grows with tp (the data behind
    ``tensorpar plan --plot``)."""
    model, rows = source_of(model), []
    for tp in model.valid_tp_sizes():
        r = plan(model, replace(layout, tp=tp), hardware)
        rows.append({"tp": tp, "devices": tp * layout.pp * layout.dp, "feasible": r.feasible,
                     "memory_per_device": r.memory_per_device,
                     "comm_bytes_per_device_per_step": r.comm["bytes_sent_per_device_per_step"],
                     "step_time_lower_bound_s": r.step_time_lower_bound_s,
                     "decode_time_per_token_lower_bound_s": r.decode_time_per_token_lower_bound_s})
    return rows
