""""Will more tp help?": decode latency and throughput at every valid tp, from the estimates.

For inference, each added tensor-parallel rank splits the work of a decode step (weights read,
FLOPs) but adds its collectives (two all-reduces per layer, each with its latency). Past some tp
the compute saved is smaller than the latency added: :func:`search_tp` finds that point from the
estimate's own terms (:mod:`.estimate`): ``work`` (matmuls, attention, elementwise, fixed costs)
against ``collectives`` (tensor-parallel and pipeline).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .hardware import Hardware
from .layout import Layout
from .profile import Profile
from .report import plan
from .source import source_of

PAYS = 0.05  # a tp "pays" when its decode step is at least 5% faster than the previous valid tp's
WORK = ("gemm_s", "attention_s", "elementwise_s", "fixed_s")
COMM = ("tp_comm_s", "tp_wait_s", "pp_comm_s")  # what each added rank costs: its calls and their waits


@dataclass
class TpSearch:
    hardware: str
    profile: str
    micro_batch: int
    context: int
    rows: list = field(default_factory=list)
    best: dict | None = None
    stops_paying_at: int | None = None
    explanation: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def search_tp(model, hardware: Hardware, *, profile: Profile | None = None, micro_batch: int = 1,
              seq: int | None = None, dtype: str = "bf16", max_tp: int | None = None) -> TpSearch:
    """Every valid tp of ``model`` up to ``max_tp`` (default: the devices of one node), planned for
    inference: decode per token, tokens/s, prefill, memory, and the estimate's work and collective
    terms; the best tp and the first tp that no longer pays (:data:`PAYS`)."""
    src = source_of(model)
    limit = hardware.devices_per_node if max_tp is None else max_tp
    rows = []
    for tp in [t for t in src.valid_tp_sizes() if t <= limit]:
        r = plan(src, Layout(tp=tp, micro_batch=micro_batch, dtype=dtype, workload="inference"), hardware,
                 profile=profile, seq=seq)
        e = r.estimates or {}
        d = e.get("decode") or {}
        terms = d.get("terms", {})
        rows.append({"tp": tp, "feasible": r.feasible, "reasons": r.reasons,
                     "decode_time_per_token_s": e.get("decode_time_per_token_s"),
                     "decode_tokens_per_s": e.get("decode_tokens_per_s"),
                     "decode_lower_bound_s": r.decode_time_per_token_lower_bound_s,
                     "prefill_time_s": e.get("prefill_time_s"),
                     "memory_per_device_bytes": (r.memory_per_device or {}).get("total"),
                     "work_s": sum(terms.get(k, 0.0) for k in WORK), "collectives_s": sum(terms.get(k, 0.0) for k in COMM),
                     "dominant": d.get("dominant"), "profile": e.get("profile")})
    out = TpSearch(hardware=hardware.name, profile=(rows[0]["profile"] if rows else ""), micro_batch=micro_batch,
                   context=seq if seq is not None else src.seq, rows=rows)
    timed = [r for r in rows if r["feasible"] and r["decode_time_per_token_s"] is not None]
    if timed:
        out.best = min(timed, key=lambda r: (r["decode_time_per_token_s"], r["tp"]))
        out.stops_paying_at = stops_paying([(r["tp"], r["decode_time_per_token_s"]) for r in timed])
    out.explanation = _explain(out, timed, rows)
    return out


def stops_paying(times: list) -> int | None:
    """The first tp of ``[(tp, seconds per token)]`` (ascending tp) not at least :data:`PAYS`
    faster than the one before it; None when every one is."""
    return next((b for (_, ta), (b, tb) in zip(times, times[1:]) if tb > (1 - PAYS) * ta), None)


def _explain(out: TpSearch, timed: list, rows: list) -> list[str]:
    if not timed:
        why = rows[0]["reasons"][0] if rows and rows[0]["reasons"] else "no valid tp"
        return [f"No tp up to this limit fits or decodes: {why}"]
    best, lines = out.best, []
    lines.append(f"Fastest decode: tp={best['tp']}, {_ms(best['decode_time_per_token_s'])} per token "
                 f"({best['decode_tokens_per_s']:,.0f} tokens/s at batch {out.micro_batch}).")
    if out.stops_paying_at is not None:
        prev = [r for r in timed if r["tp"] < out.stops_paying_at][-1]
        cur = next(r for r in timed if r["tp"] == out.stops_paying_at)
        saved = prev["work_s"] - cur["work_s"]
        added = cur["collectives_s"] - prev["collectives_s"]
        lines.append(f"Adding ranks stops paying at tp={cur['tp']}: from tp={prev['tp']} it saves "
                     f"{_ms(saved)} of work per token but adds {_ms(added)} of collectives "
                     f"({_ms(prev['decode_time_per_token_s'])} -> {_ms(cur['decode_time_per_token_s'])}).")
    else:
        lines.append(f"Every tp up to {timed[-1]['tp']} pays (each at least {PAYS:.0%} faster than the one before).")
    unfit = [r["tp"] for r in rows if not r["feasible"]]
    if unfit:
        lines.append(f"Does not fit or is refused at tp={', '.join(map(str, unfit))}.")
    return lines


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"
