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


def models_table(rows: list[dict]) -> str:
    head = ("| model | pass | tensorpar tp=2 | HF tp_plan=auto tp=2 | dense, 2 threads | "
            "tensorpar / HF TP | tensorpar / dense | params per rank / total |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|\n")
    med = [r["median_s"] for r in rows]
    body = [f"| {r['label']} | {r['pass']} | {_ms(m['tensorpar'], 4)} | {_ms(m['hf_tp'], 4)} | "
            f"{_ms(m['dense_2t'], 4)} | **{r['tensorpar_vs_hf_tp']:.2f}** | {r['tensorpar_vs_dense_2t']:.2f} | "
            f"{r['param_bytes_per_rank'] / r['param_bytes_total']:.3f} |" for r, m in zip(rows, med)]
    return head + "\n".join(body) + "\n"


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
