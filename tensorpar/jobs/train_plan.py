"""`tensorpar train`'s run beside its plan: each rank's model states and one step's collectives
as the ledger recorded them, next to what the planner predicts for the same rank
(:func:`tensorpar.planner.mesh.mesh_step` / ``state_bytes``, with pipeline stages
:func:`tensorpar.planner.pipeline_step.pipeline_step` / ``pipeline_state_bytes``), and with a
hardware profile the planner's step time beside the measured one (:func:`time_estimate`)."""
from __future__ import annotations

import statistics
from collections import Counter

from tensorpar.jobs.common import DTYPES
from tensorpar.jobs.train_checks import ZERO
from tensorpar.planner import Layout, plan
from tensorpar.planner.mesh import mesh_step, state_bytes
from tensorpar.planner.pipeline_step import pipeline_state_bytes, pipeline_step
from tensorpar.planner.profile import load
from tensorpar.planner.runtime import generic_name
from tensorpar.sharding.inventory import MetaSource


def ledger_step(start: int, steps: int) -> int:
    """The step the ledger records: the run's third, past the one-off exchanges of the first two
    (the pipeline's shape inference in the first, DDP's rebuilt buckets broadcast in the second),
    or its last when it runs fewer (its report then lists those exchanges as unplanned calls)."""
    return min(start + 3, steps)


def by_dimension(led, mesh, model) -> list:
    """``[(mesh dimension, op, module pattern, phase, payload bytes, bytes sent)]`` of the ledger's
    records (a pipeline's tied-embedding group counted as pp)."""
    names = {mesh[k].get_group().group_name: k for k in mesh.mesh_dim_names}
    tied = getattr(model, "_tied_group", None)
    if tied is not None:
        names[tied.group_name] = "pp"
    return [(names.get(r.group, r.group), r.op, generic_name(r.module) or "cross_entropy", r.phase,
             r.payload_bytes, r.bytes_sent) for r in led.records]


def with_plan(cfg, inv, per_rank: list, pipe: dict | None) -> list:
    """Each rank's memory with the planner's figure for the same rank beside it
    (:func:`tensorpar.planner.mesh.state_bytes` over the model's inventory: parameters, gradients and
    AdamW's two moments; the measured optimizer bytes also hold AdamW's step counters)."""
    e = DTYPES[cfg.dtype].itemsize
    out = []
    for r in per_rank:
        m, c = r["memory"], r["coords"]
        if pipe is not None:
            planned = pipeline_state_bytes(inv, pp=cfg.pp, dp=cfg.dp, data_parallel=ZERO[cfg.zero], e=e,
                                           schedule=pipe["schedule"], virtual=pipe["virtual_stages"],
                                           pp_rank=c["pp"], tp_rank=c["tp"], dp_rank=c["dp"])
        else:
            planned = state_bytes(inv, dp=cfg.dp, data_parallel=ZERO[cfg.zero], e=e, tp_rank=c["tp"], dp_rank=c["dp"])
        out.append({**m, "planned_state_bytes": planned["total"], "planned": planned})
    return out


def sent_by(item, rank: int) -> float:
    """Bytes group rank ``rank`` sends for ``item`` (one figure when every rank sends as many)."""
    per = item.bytes_sent_per_rank
    return (per[rank] if len(per) > 1 else per[0]) * item.count


def communication(cfg, plan: dict, per_rank: list) -> list:
    """Each rank's collectives and transfers of the recorded step beside the planner's prediction
    for the same rank (:func:`tensorpar.planner.mesh.mesh_step`, or
    :func:`tensorpar.planner.pipeline_step.pipeline_step` with pipeline stages), call by call:
    ``equal`` when every (dimension, op, module, phase, payload) has the same count."""
    inv, e = plan["inventory"], DTYPES[cfg.dtype].itemsize
    pipe = plan["pipeline"]
    out = []
    for r in per_rank:
        if r["ledger"] is None:
            continue
        c = r["coords"]
        common = dict(dp=cfg.dp, data_parallel=ZERO[cfg.zero], sequence_parallel=cfg.sequence_parallel,
                      batch=cfg.batch, seq=cfg.seq, e=e, tp_rank=c["tp"], clip=True)
        if pipe is None:
            predicted = mesh_step(inv, **common)
        else:
            predicted = pipeline_step(inv, pp=cfg.pp, schedule=pipe["schedule"], microbatches=pipe["microbatches"],
                                      virtual=pipe["virtual_stages"], pp_rank=c["pp"], **common)
        want = Counter()
        for dim, items in predicted.items():
            for i in items:
                want[(dim, i.op, i.where, i.phase, i.payload_bytes)] += i.count
        got = Counter((d, op, where, phase, payload) for d, op, where, phase, payload, _ in r["ledger"]["records"]
                      if d in ("tp", "dp", "pp"))
        sent = sum(b for *_, b in r["ledger"]["records"])
        planned = sum(sent_by(i, c[dim]) for dim, items in predicted.items() for i in items)
        out.append({"rank": r["memory"]["rank"], "step": r["ledger"]["step"], "calls": sum(got.values()),
                    "planned_calls": sum(want.values()), "bytes_sent": sent, "planned_bytes_sent": planned,
                    "equal": got == want,
                    "only_recorded": [list(k) + [n] for k, n in (got - want).items()],
                    "only_planned": [list(k) + [n] for k, n in (want - got).items()]})
    return out


PLANNER_DTYPES = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16"}


def time_estimate(cfg, model_path, history: list, pipe: dict | None, profile_file: str | None) -> dict | None:
    """The planner's step time from a hardware profile (``tensorpar calibrate``'s ``profile_file``)
    beside the run's: the median of rank 0's steps past the first two and the ledger's (warm-up,
    one-off exchanges, recording); None without a profile."""
    if profile_file is None:
        return None
    profile = load(profile_file)
    m = pipe["microbatches"] if pipe is not None else 1
    layout = Layout(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, micro_batch=cfg.batch // (cfg.dp * m), global_batch=cfg.batch,
                    dtype=PLANNER_DTYPES[cfg.dtype], zero_stage=3 if cfg.zero == 3 else 0,
                    sequence_parallel=cfg.sequence_parallel, schedule=pipe["schedule"] if pipe else "1F1B",
                    virtual_stages=pipe["virtual_stages"] if pipe else None)
    est = plan(MetaSource(model_path), layout, profile.hardware, seq=cfg.seq, profile=profile).estimates
    skip = {h["step"] for h in history[:2]} | {ledger_step(history[0]["step"] - 1, history[-1]["step"])} \
        if len(history) > 3 else set()
    timed = [h["seconds"] for h in history if h["step"] not in skip] or [h["seconds"] for h in history]
    measured = statistics.median(timed)
    return {"profile": profile.name, "profile_file": str(profile_file), "estimate_s": est["step_time_s"],
            "measured_s": measured, "steps_timed": len(timed), "measured_vs_estimate": measured / est["step_time_s"],
            "terms": est["step"]["terms"], "dominant": est["step"]["dominant"]}
