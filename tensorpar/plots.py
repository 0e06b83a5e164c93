"""PNG figures of planner results (matplotlib, imported only when a figure is drawn)."""
from __future__ import annotations

_PARTS = (("weights", "tab:blue"), ("gradients", "tab:purple"), ("optimizer", "tab:olive"),
          ("activations", "tab:green"), ("kv_cache", "tab:cyan"))


def plot_tp_sweep(rows: list[dict], path: str, *, title: str = "") -> str:
    """Memory per device (stacked by part, capacity dashed) and tensor-parallel bytes sent per
    device per step against tp, from :func:`tensorpar.planner.search.tp_sweep` rows. Returns path."""
    if not rows:
        raise ValueError("nothing to plot: no valid tp sizes")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    labels = [str(r["tp"]) if r["feasible"] else f"{r['tp']}\n(infeasible)" for r in rows]
    x = list(range(len(rows)))
    fig, (ax_mem, ax_comm) = plt.subplots(1, 2, figsize=(11, 4.2))
    bottom = [0.0] * len(rows)
    for part, color in _PARTS:
        values = [r["memory_per_device"][part] / 1e9 for r in rows]
        if any(values):
            ax_mem.bar(x, values, bottom=bottom, color=color, label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
    capacity = rows[0]["memory_per_device"]["capacity"] / 1e9
    ax_mem.axhline(capacity, color="red", linestyle="--", label=f"capacity {capacity:.0f} GB")
    ax_mem.set(xticks=x, xticklabels=labels, xlabel="tp", ylabel="GB per device", title="memory per device")
    ax_mem.legend(fontsize=8)
    for group, style in (("tp", "o-"), ("pp", "s--"), ("dp", "^:")):
        values = [r["comm_bytes_per_device_per_step"][group] / 1e9 for r in rows]
        if any(values):
            ax_comm.plot(x, values, style, label=f"{group} collectives")
    ax_comm.set(xticks=x, xticklabels=labels, xlabel="tp", ylabel="GB sent per device per step",
                title="communication per step (ring bytes)")
    ax_comm.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
