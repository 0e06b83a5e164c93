"""`tensorpar plan`'s tables (rich): one layout's memory, communication, pipeline and time, or a
search's ranked layouts; the numbers come from :mod:`tensorpar.planner`, this only lays them out.
"""
from __future__ import annotations

from tensorpar import planner
from tensorpar.cli import progress


# ---- text report (rich, imported only here) ------------------------------------------------------

_PARTS = (("weights", "blue", "W"), ("gradients", "magenta", "G"), ("optimizer", "yellow", "O"),
          ("activations", "green", "A"), ("kv_cache", "cyan", "K"))


def print_result(result) -> None:
    console = progress.console(highlight=False)
    if isinstance(result, planner.SearchResult):
        _render_search(console, result)
    else:
        _render_plan(console, result)


def _render_plan(console, r: planner.PlanReport) -> None:
    m, lay, hw = r.model, r.layout, r.hardware
    console.print(f"[bold]{m['name']}[/] ({m['family']}, {r.params:,} parameters) on [bold]{hw['name']}[/]: "
                  f"tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} ({lay['devices']} devices), {lay['workload']}, "
                  f"{lay['dtype']}, micro-batch {lay['micro_batch']}, global batch {lay['global_batch']}, "
                  f"seq {m['seq']} ({m['seq_source']}), recompute {lay['recompute']}"
                  + (", sequence parallel" if lay["sequence_parallel"] else ""))
    console.print("[green]feasible[/]" if r.feasible else "[bold red]NOT feasible[/]")
    for line in r.reasons:
        console.print(f"  [red]x[/] {line}")
    for fix in r.fixes:
        console.print(f"  [yellow]fix[/] {fix['fix']}: {fix['cost']}")
    for line in r.warnings:
        console.print(f"  [yellow]![/] {line}")
    for block, why in r.whole.items():
        console.print(f"  [yellow]whole[/] {block}: {why}")
    if r.memory_per_device is None:
        console.print(f"valid tp sizes: {', '.join(map(str, r.valid_tp_sizes))}")
        return
    console.print(_summary_table(r))
    console.print(_memory_table(r.memory_per_device))
    console.print(_memory_bar(r.memory_per_device))
    console.print(_comm_table(r))
    if lay["pp"] > 1:
        console.print(_pipeline_table(r.pipeline))
    console.print(_time_table(r))
    for note in r.notes:
        console.print(f"- {note}")


def _table(title, *columns):
    from rich.table import Table

    t = Table(title=title, title_justify="left", title_style="bold")
    for c in columns:
        t.add_column(c, justify="left" if c in ("", "op", "where", "phase", "group", "part", "bound") else "right")
    return t


def _summary_table(r):
    t = _table("model and split", "", "value")
    kv = r.kv_cache_bytes_per_token
    t.add_row("parameters / per device", f"{r.params:,} / {r.params_per_device:,}")
    t.add_row(*_flops_row(r))
    t.add_row("activations per layer per device (one micro-batch)", _bytes(r.activation_bytes_per_layer))
    t.add_row("KV cache per token (total / per device)", f"{_bytes(kv['total'])} / {_bytes(kv['per_device'])}"
              + (f" (kv heads replicated {kv['replication']}x)" if kv["replication"] > 1 else ""))
    t.add_row("valid tp sizes", ", ".join(map(str, r.valid_tp_sizes)))
    return t


def _flops_row(r) -> tuple[str, str]:
    """Training: model / hardware FLOPs of one iteration; inference: the prefill of the global
    batch and one decode step."""
    lay, m = r.layout, r.model
    if lay["workload"] == "train":
        return (f"FLOPs per iteration, fwd + bwd (model / hardware with recompute {lay['recompute']})",
                f"{r.flops_per_iteration:.4g} / {r.hardware_flops_per_iteration:.4g}")
    f = r.inference_flops
    return (f"FLOPs: prefill of the global batch ({lay['global_batch']} x {m['seq']} tokens) / "
            f"one decode step ({lay['micro_batch']} tokens)",
            f"{f['prefill_global_batch']:.4g} / {f['decode_step']:.4g}")


def _memory_table(mem):
    t = _table(f"memory per device (stage {mem['stage']})", "part", "bytes", "share of capacity")
    for part, color, _ in _PARTS:
        t.add_row(f"[{color}]{part}[/]", _bytes(mem[part]), f"{mem[part] / mem['capacity']:.1%}")
    t.add_row("[bold]total[/]", _bytes(mem["total"]), f"{mem['total'] / mem['capacity']:.1%}")
    t.add_row("capacity", _bytes(mem["capacity"]), "")
    return t


def _memory_bar(mem, width: int = 60):
    """W weights, G gradients, O optimizer, A activations, K KV cache, . free, scaled so the
    larger of capacity and total fills ``width``; when over capacity a ``|`` marks the capacity."""
    from rich.text import Text

    scale = width / max(mem["capacity"], mem["total"])
    cells = [(letter, color, round(mem[part] * scale)) for part, color, letter in _PARTS]
    cap = round(mem["capacity"] * scale)
    bar, pos = Text("memory ["), 0
    for letter, color, n in cells:
        for _ in range(n):
            if pos == cap and mem["total"] > mem["capacity"]:
                bar.append("|", style="bold red")
            bar.append(letter, style=color)
            pos += 1
    bar.append("." * max(0, width - pos), style="dim")
    bar.append("]")
    over = mem["total"] > mem["capacity"]
    bar.append(f" {mem['total'] / mem['capacity']:.0%} of {_bytes(mem['capacity'])}"
               + (" OVER CAPACITY (| marks it)" if over else ""), style="bold red" if over else "")
    bar.append("  W weights, G gradients, O optimizer, A activations, K kv cache")
    return bar


def _comm_table(r):
    c = r.comm
    step = "per step" if r.layout["workload"] == "train" else "per step (prefill of the global batch)"
    t = _table(f"communication {step}, one device of stage {c['stage']} (ring bytes sent)",
               "group", "op", "where", "phase", "payload N", "sent/device", "count", "total sent")
    for i in c["per_step"]:
        phase = i["phase"] + (" (recomputed)" if i["recomputed"] else "")
        t.add_row(f"{i['group']}({i['group_size']})", i["op"], i["where"], phase, _bytes(i["payload_bytes"]),
                  _bytes(i["bytes_sent_per_device"]), str(i["count"]), _bytes(i["bytes_sent_per_device"] * i["count"]))
    t.add_row("", "", "[bold]total[/]", "", "", "", "", _bytes(c["bytes_sent_per_device_per_step"]["total"]))
    return t


def _pipeline_table(p):
    """One row per stage: its rank, blocks, parameters, activations and the bytes at its boundary."""
    alive = {x["rank"]: x for x in p["ranks"]}
    t = _table(f"pipeline: {p['schedule']}, {p['virtual_stages']} stage(s) per rank, {p['microbatches']} microbatches "
               f"of {p['microbatch_size']}; bubble {p['bubble_fraction']:.1%} of the step ({p['bubble_source']})",
               "stage", "rank", "blocks", "params/rank", "activations/microbatch", "alive on rank",
               "in flight on rank", "p2p/microbatch fwd + bwd")
    for s in p["stages"]:
        rank, sent = alive[s["rank"]], s["p2p_bytes_per_microbatch"]
        per_mb = s["activation_bytes_per_microbatch"]
        t.add_row(str(s["stage"]), str(s["rank"]), f"{s['blocks'][0]}-{s['blocks'][1] - 1}", f"{s['params_per_rank']:,}",
                  _bytes(per_mb) if per_mb is not None else "", str(rank["microbatches_alive"] or ""),
                  _bytes(rank["activation_bytes_in_flight"]) if rank["activation_bytes_in_flight"] is not None else "",
                  "local" if s["next_stage_on_same_rank"] else _bytes(sent["forward"] + sent["backward"]))
    return t


def _time_table(r):
    e = r.estimates
    title = (f"time: lower bounds (no system beats them) and estimates (not bounds; {e['profile']}, "
             f"{e['runtime']} runtime)")
    if r.layout["workload"] != "train":
        title += (f"; here a step is the prefill of the global batch, {r.layout['global_batch']} x "
                  f"{r.model['seq']} tokens")
    t = _table(title, "figure", "lower bound", "estimate", "largest term of the estimate")
    by = r.comm_time_lower_bound_by_link
    step = e["step"]
    t.add_row("compute per step", _s(r.compute_time_lower_bound_s),
              _s(sum(step["terms"].get(k, 0.0) for k in ("gemm_s", "attention_s", "elementwise_s"))), "")
    t.add_row(f"communication per step (intra {_s(by['intra_node_s'])}, inter {_s(by['inter_node_s'])})",
              _s(r.comm_time_lower_bound_s), _s(e["comm_time_s"]), "")
    t.add_row(f"step (pipeline bubble {e['pipeline_bubble_fraction']:.0%} in the estimate)",
              _s(r.step_time_lower_bound_s), _s(e["step_time_s"]), _dominant(step))
    ceiling, m = r.decode_steps_per_s_upper_bound, r.model
    label = f"decode per token, context {m['seq']}"
    if m["sliding_window"] is not None:
        label += f" (window {m['sliding_window']} in {m['window_layers']} of {m['layers']} layers)"
    t.add_row(label + (f" (<= {ceiling:,.0f} steps/s)" if ceiling else ""),
              _s(r.decode_time_per_token_lower_bound_s), _s(e["decode_time_per_token_s"]), _dominant(e["decode"]))
    t.add_row(f"prefill of {r.model['seq']} tokens x {r.layout['micro_batch']}", _s(r.prefill_time_lower_bound_s),
              _s(e["prefill_time_s"]), _dominant(e["prefill"]))
    kv = r.kv_transfer
    t.add_row(f"KV transfer, {kv['tokens']:,} tokens ({_bytes(kv['bytes_per_device'])}/device) over {kv['link']}",
              _s(r.kv_transfer_time_lower_bound_s), "", "")
    return t


def _dominant(part: dict | None) -> str:
    """The estimate's largest term and its share (``gemm_s`` -> ``matmuls 71%``)."""
    if not part or not part.get("dominant"):
        return ""
    names = {"gemm_s": "matmuls", "attention_s": "attention", "elementwise_s": "elementwise", "fixed_s": "fixed costs",
             "tp_comm_s": "tp collectives", "tp_wait_s": "wait for the slower rank", "pp_comm_s": "pipeline sends",
             "dp_comm_s": "dp collectives",
             "bubble_s": "pipeline bubble", "optimizer_s": "optimizer"}
    k = part["dominant"]
    return f"{names.get(k, k)} {part['terms'][k] / part['seconds']:.0%}"


def _render_search(console, s: planner.SearchResult) -> None:
    unit = "step" if s.objective == "step_time" else "decode per token"
    comm_col = "comm/step" if s.objective == "step_time" else "comm/prefill"
    t = _table(f"{s.devices} devices, {s.devices_per_node} per node: layouts ranked by {unit}",
               "tp", "pp", "dp", "feasible", "lower bound", "estimate", "memory/device", comm_col, "why not")
    for r in s.candidates:
        mem = "" if r["memory_per_device_bytes"] is None else _bytes(r["memory_per_device_bytes"])
        comm = "" if r["comm_bytes_per_device_per_step"] is None else _bytes(r["comm_bytes_per_device_per_step"])
        t.add_row(str(r["tp"]), str(r["pp"]), str(r["dp"]), "yes" if r["feasible"] else "[red]no[/]",
                  _s(r["bound_s"]), _s(r["estimate_s"]), mem, comm, why_not(r["reasons"]))
    console.print(t)
    for line in s.explanation:
        console.print(f"- {line}")
    if s.command:
        console.print(f"Run it: {s.command}", soft_wrap=True)


def why_not(reasons: list[str], width: int = 60) -> str:
    """The first reason up to its first ";" (the list of valid choices follows it); when that is
    longer than ``width``, without its last parenthetical that starts within ``width`` (the
    memory breakdown), else cut with "…"; and how many more reasons there are."""
    if not reasons:
        return ""
    text = reasons[0].split(";")[0]
    if len(text) > width:
        aside = text.rfind(" (", 0, width)
        text = text[:aside] if aside > width // 3 else text[:width - 1].rstrip() + "…"
    return text + (f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else "")


def _bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _s(seconds) -> str:
    if seconds is None:
        return "n/a"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.2f} us"
