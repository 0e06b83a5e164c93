"""Benchmark rows -> markdown tables and PNG plots (files; the CLI does the printing)."""
from __future__ import annotations

import json
from pathlib import Path


def _ms(s: float, digits: int = 3) -> str:
    return f"{s * 1e3:.{digits}g} ms"


def mlp_table(rows: list[dict]) -> str:
    head = ("| tokens | hidden | pass | tensorpar | PyTorch TP | dense, 2 threads | floor | "
            "tensorpar / PyTorch TP | tensorpar / floor | tensorpar / dense |\n"
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = [f"| {r['tokens']} | {r['hidden']} | {r['pass']} | {_ms(r['median_s']['tensorpar'])} | "
             f"{_ms(r['median_s']['torch_tp'])} | {_ms(r['median_s']['dense_2t'])} | {_ms(r['median_s']['floor'])} | "
             f"**{r['tensorpar_vs_torch_tp']:.2f}** | **{r['tensorpar_vs_floor']:.2f}** | {r['tensorpar_vs_dense_2t']:.2f} |"
             for r in rows]
    return head + "\n".join(lines) + "\n"


_OP_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC"}


def _ops(counts: dict | None) -> str:
    """``{"all_reduce": 13, "all_gather": 1}`` -> ``13 AR + 1 AG``."""
    if counts is None:
        return "–"
    return " + ".join(f"{n} {_OP_SHORT.get(op, op)}" for op, n in counts.items()) or "none"


def _cell(text: str, limit: int = 110) -> str:
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return text.replace("|", "\\|")


def _model_row(r: dict) -> str:
    med, error, total = r["median_s"], r.get("hf_tp_error"), r["param_bytes_total"]
    hf_time = f"failed: {_cell(error)}" if error else _ms(med["hf_tp"], 4)
    vs_hf = "–" if r.get("tensorpar_vs_hf_tp") is None else f"**{r['tensorpar_vs_hf_tp']:.2f}**"
    hf_bytes = r.get("hf_tp_param_bytes_per_rank")
    params = f"{r['param_bytes_per_rank'] / total:.3f}, " + ("–" if hf_bytes is None else f"{hf_bytes / total:.3f}")
    counts = r.get("collectives", {})
    comm = f"{_ops(counts.get('tensorpar'))}; {_ops(counts.get('hf_tp'))}" if counts else "–"
    return (f"| {r['label']} | {r['pass']} | {_ms(med['tensorpar'], 4)} | {hf_time} | {_ms(med['dense_2t'], 4)} | "
            f"{vs_hf} | {r['tensorpar_vs_dense_2t']:.2f} | {params} | {comm} |")


def models_table(rows: list[dict]) -> str:
    """One row per model and pass; where HF's tp_plan failed, its time cell says why."""
    head = ("| model | pass | tensorpar tp=2 | HF tp_plan=auto tp=2 | dense, 2 threads | "
            "tensorpar / HF TP | tensorpar / dense | params per rank / total (tensorpar, HF) | "
            "collectives per pass (tensorpar; HF) |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---|\n")
    return head + "\n".join(_model_row(r) for r in rows) + "\n"


def decode_table(rows: list[dict]) -> str:
    """One row per batch size: time per token of each variant, the ratios the issue sets targets
    for, the planner's bound for this machine, and the share of a step in collectives."""
    head = ("| batch | shm | shm, HF forward | gloo | HF tp_plan | dense, 2 threads | dense lean, 2 threads | "
            "shm / HF TP | shm / dense | shm / dense lean | planner bound (this machine) | shm: in collectives | "
            "gloo: in collectives | collectives, bytes per token | same tokens as dense |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n")
    lines = []
    for r in rows:
        t, shm, gloo = r["per_token_s"], r["shm_collectives"], r["gloo_collectives"]
        same = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in r["same_tokens_as_dense"].items())
        times = " | ".join(_ms(t[name]) for name in ("shm", "shm_hf", "gloo", "hf_tp", "dense_2t", "dense_lean_2t"))
        lines.append(f"| {r['batch']} | {times} | **{r['shm_vs_hf_tp']:.2f}** | **{r['shm_vs_dense_2t']:.2f}** | "
                     f"{r['shm_vs_dense_lean_2t']:.2f} | {_ms(r['planner_bound_s'])} | "
                     f"{_share(shm)} | {_share(gloo)} | {shm['collectives_per_token']:g}, "
                     f"{shm['bytes_sent_per_token']:g} B | {same} |")
    return head + "\n".join(lines) + "\n"


def _share(c: dict) -> str:
    share = c["share_in_collectives"]
    return f"{_ms(c['collective_s_per_token'])} ({share:.0%})" if share is not None else _ms(c["collective_s_per_token"])


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _ratio(x, bold: bool = False) -> str:
    if x is None:
        return "–"
    return f"**{x:.2f}**" if bold else f"{x:.2f}"


_TRAIN_NAMES = {"tp_dp2_ddp": "tensorpar DDP", "tp_dp2_fsdp": "tensorpar FSDP", "torch_fsdp2_dp2": "PyTorch FSDP2",
                "tp_tp2": "tensorpar TP", "torch_dtensor_tp2": "PyTorch DTensor TP", "dense_2t": "dense, 2 threads"}


def _train_step_row(r: dict) -> str:
    g = r["guard"]
    checks = (f"{g['loss_rel_err']:.1e}, {g['step2_loss_rel_err']:.1e}, {g['grad_norm_rel_err']:.1e}"
              if "loss_rel_err" in g else f"reference (norm {g['grad_norm_rel_err']:.1e})")
    base = f" / {_TRAIN_NAMES[r['baseline']]}" if r["baseline"] else ""
    return (f"| {_TRAIN_NAMES[r['variant']]} | {r['layout']} | {_ms(r['median_s'], 4)} | {r['tokens_per_s']:.0f} | "
            f"{_ratio(r['vs_baseline'], bold=True)}{base} | {_ratio(r['vs_dense_2t'])} | {checks} |")


def _train_ckpt_row(r: dict) -> str:
    name = f"{r['implementation']} ({_TRAIN_NAMES[r['variant']]})"
    written, held = r["bytes_written_per_rank"], r["shard_bytes_per_rank"]
    return (f"| {name} | {r['layout']} | {_ms(r['save_s'], 4)} | {_ms(r['load_s'], 4)} | "
            f"{_ratio(r['save_vs_baseline'], bold=True)} | {_ratio(r['load_vs_baseline'], bold=True)} | "
            f"{', '.join(_mb(w) for w in written)} | {', '.join(_mb(h) for h in held)} | "
            f"{', '.join(f'{x:.3f}' for x in r['written_vs_shard'])} |")


def train_table(rows: list[dict]) -> str:
    """Two tables: one row per training-step variant (median step, tokens/s, the paired ratios to
    its PyTorch baseline and to the unsplit model, the guard's relative differences from the dense
    model), then one per checkpointer (save and load medians, the ratios to PyTorch's DCP at the
    same layout, bytes written per rank against the rank's shard)."""
    steps = [r for r in rows if r["kind"] == "step"]
    ckpts = [r for r in rows if r["kind"] == "checkpoint"]
    head = ("| variant | layout | step | tokens/s | / PyTorch | / dense | rel. diff from dense: loss 1, loss 2, "
            "grad norm |\n|---|---|---:|---:|---|---:|---|\n")
    table = head + "\n".join(_train_step_row(r) for r in steps) + "\n"
    if ckpts:
        table += ("\n| checkpoint | layout | save | load | save / DCP | load / DCP | written per rank | "
                  "shard per rank (params + AdamW) | written / shard |\n"
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
        table += "\n".join(_train_ckpt_row(r) for r in ckpts) + "\n"
    return table


_RATIO_TICKS = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 7.0, 10.0, 20.0)


def plot_model_ratios(rows: list[dict], path: Path, keys: dict, title: str) -> Path:
    """Grouped bars from parity (1.0), one group per model, one bar per ratio in ``keys``
    ({row key: legend}), one panel per pass; a ratio that is ``None`` (its baseline failed) is
    marked on the axis instead of drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    passes = list(dict.fromkeys(r["pass"] for r in rows))
    fig, axes = plt.subplots(1, len(passes), figsize=(5.5 * len(passes), 4.2), squeeze=False)
    width = 0.8 / len(keys)
    for ax, name in zip(axes[0], passes):
        sel = [r for r in rows if r["pass"] == name]
        for j, (key, legend) in enumerate(keys.items()):
            xs = [i + (j - (len(keys) - 1) / 2) * width for i in range(len(sel))]
            vals = [r.get(key) for r in sel]
            bars = ax.bar([x for x, v in zip(xs, vals) if v is not None],
                          [v - 1.0 for v in vals if v is not None], width, bottom=1.0, label=legend)
            ax.bar_label(bars, labels=[f"{v:.2f}" for v in vals if v is not None], fontsize=7)
            for x, v in zip(xs, vals):
                if v is None:
                    ax.annotate("failed", (x, 1.0), ha="center", va="bottom", fontsize=8, rotation=90, color="red")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_yscale("log")  # ratios: 0.5 and 2 sit equally far from parity
        shown = [1.0] + [r[k] for r in sel for k in keys if r.get(k) is not None]
        lo, hi = min(shown) / 1.3, max(shown) * 1.3  # room for the labels at both ends
        ax.set_ylim(lo, hi)
        ax.set_yticks([t for t in _RATIO_TICKS if lo <= t <= hi])
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%.2g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xticks(range(len(sel)), [r["label"] for r in sel], rotation=15, fontsize=8)
        ax.set_xlim(-0.5, len(sel) - 0.5)  # every slot, a failed one without a bar too
        ax.set_title(f"{title}: {name}")
        ax.set_ylabel("time ratio (lower is better for tensorpar)")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(keys))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ratios(rows: list[dict], path: Path, keys: dict, title: str) -> Path:
    """One line per ratio in ``keys`` ({row key: legend}), x = size label, per pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    passes = sorted({r["pass"] for r in rows})
    fig, axes = plt.subplots(1, len(passes), figsize=(5 * len(passes), 3.6), squeeze=False)
    for ax, name in zip(axes[0], passes):
        sel = [r for r in rows if r["pass"] == name]
        labels = [r.get("label") or f"{r['tokens']}x{r['hidden']}" for r in sel]
        for key, legend in keys.items():
            ax.plot(labels, [r[key] for r in sel], marker="o", label=legend)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_yscale("log")  # ratios: 0.5 and 2 sit equally far from parity
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%.2g"))
        ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%.2g"))
        ax.set_title(f"{title}: {name}")
        ax.set_ylabel("time ratio (lower is better for tensorpar)")
        ax.tick_params(axis="x", rotation=30)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_json(obj, path: Path) -> Path:
    path.write_text(json.dumps(obj, indent=2, default=float))
    return path
