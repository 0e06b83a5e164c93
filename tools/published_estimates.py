"""The planner's estimates of the published runs in ../shared/reference_cases (tests/data copy) that
have a measured time, beside the measurement: the table docs/planner.md quotes.

    .venv/bin/python tools/published_estimates.py

Each estimate uses a hardware preset's public figures (tensorpar.planner.profile.PUBLISHED) and
the runtime the paper describes (tensorpar.planner.estimate.MEGATRON_2020 / MEGATRON_2021); the
layouts are the papers' (tests/test_planner_estimate.py states them and checks every ratio is
within 20%).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorpar.planner import Layout, plan  # noqa: E402
from tensorpar.planner import estimate as est  # noqa: E402
from tensorpar.planner.hardware import get_hardware  # noqa: E402
from tensorpar.planner.models import get_model  # noqa: E402
from tests.test_planner_estimate import MEGATRON, NARAYANAN, _gpt  # noqa: E402
from tests.test_planner_cases import BY_ID  # noqa: E402


def rows() -> list:
    out = []
    for case in MEGATRON:
        i = case["inputs"]
        lay = Layout(tp=i["tp"], pp=i["pp"], dp=i["dp"], micro_batch=i["global_batch"] // i["dp"],
                     global_batch=i["global_batch"], recompute=i["activation_recompute"], dtype="fp16")
        e = plan(_gpt(i), lay, get_hardware(i["hardware"]["name"]), runtime=est.MEGATRON_2020).estimates
        out.append((case["id"], f"tp {i['tp']} dp {i['dp']}, {i['hardware']['name']}", "iteration",
                    case["expected"]["iteration_time_s"], e["step_time_s"], e["step"]["dominant"]))
    for cid, model, t, p, batch in NARAYANAN:
        i, m = BY_ID[cid]["inputs"], get_model(model)
        lay = Layout(tp=t, pp=p, dp=i["n_gpus"] // (t * p), micro_batch=1, global_batch=batch, recompute="full",
                     dtype="fp16", schedule="1F1B")
        e = plan(m, lay, get_hardware("a100-80gb"), runtime=est.MEGATRON_2021).estimates
        days = i["tokens"] / (batch * m.seq) * e["step_time_s"] / 86400
        out.append((cid, f"tp {t} pp {p} dp {lay.dp}, A100", "training days", BY_ID[cid]["expected"]["training_days"],
                    days, e["step"]["dominant"]))
    return out


if __name__ == "__main__":
    print("| case | layout | figure | published | estimate | estimate / published |\n|---|---|---|---:|---:|---:|")
    for cid, layout, what, measured, guess, _ in rows():
        print(f"| {cid} | {layout} | {what} | {measured:.4g} | {guess:.4g} | {guess / measured:.2f} |")
