"""PNG figures of planner results (matplotlib, imported only when a figure is drawn)."""
from __future__ import annotations

_PARTS = (("weights", "tab:blue"), ("gradients", "tab:purple"), ("optimizer", "tab:olive"),
          ("activations", "tab:green"), ("kv_cache", "tab:cyan"))
_INFEASIBLE = "//"  # hatch of the bars of infeasible layouts


def plot_tp_sweep(rows: list[dict], path: str, *, title: str = "", devices_per_node: int | None = None,
                  step: str = "per step") -> str:
    """Memory per device (stacked by part, capacity dashed, infeasible tp hatched) and bytes sent
    per device per step against tp (infeasible hollow), from
    :func:`tensorpar.planner.search.tp_sweep` rows. A dotted line marks ``devices_per_node``: tp
    to its right spans nodes. ``step`` names what one step is (inference: a prefill). Returns ``path``."""
    if not rows:
        raise ValueError("nothing to plot: no valid tp sizes")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_comm) = plt.subplots(1, 2, figsize=(11, 4.6))
    _memory_bars(ax_mem, rows)
    _comm_lines(ax_comm, rows, step)
    some_infeasible = not all(r["feasible"] for r in rows)
    for ax, mark in ((ax_mem, "hatched"), (ax_comm, "hollow")):
        ax.set_xticks(range(len(rows)), [str(r["tp"]) for r in rows])
        ax.set_xlabel("tp" + (f"  ({mark}: infeasible)" if some_infeasible else ""))
        if devices_per_node is not None:
            _node_marker(ax, rows, devices_per_node)
        _legend(ax, some_infeasible and mark == "hatched")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _memory_bars(ax, rows: list[dict]) -> None:
    x = range(len(rows))
    hatch = [_INFEASIBLE if not r["feasible"] else None for r in rows]
    bottom = [0.0] * len(rows)
    for part, color in _PARTS:
        values = [r["memory_per_device"][part] / 1e9 for r in rows]
        if any(values):
            ax.bar(x, values, bottom=bottom, color=color, label=part, hatch=hatch, edgecolor="white")
            bottom = [b + v for b, v in zip(bottom, values)]
    capacity = rows[0]["memory_per_device"]["capacity"] / 1e9
    ax.axhline(capacity, color="red", linestyle="--", label=f"capacity {capacity:.0f} GB")
    ax.set(ylabel="GB per device", title="memory per device")


def _legend(ax, hatched: bool) -> None:
    """Legend entries drawn plain (a bar container's entry would copy its first bar's hatch), and
    one hatched entry for infeasible layouts."""
    from matplotlib.patches import Patch

    handles, labels = ax.get_legend_handles_labels()
    plain = [Patch(facecolor=h.patches[0].get_facecolor(), label=lab) if hasattr(h, "patches") else h
             for h, lab in zip(handles, labels)]
    if hatched:
        plain.append(Patch(facecolor="white", edgecolor="grey", hatch=_INFEASIBLE, label="infeasible"))
    ax.legend(handles=plain, fontsize=8)


def _comm_lines(ax, rows: list[dict], step: str) -> None:
    x = list(range(len(rows)))
    for group, style in (("tp", "o-"), ("pp", "s--"), ("dp", "^:")):
        values = [r["comm_bytes_per_device_per_step"][group] / 1e9 for r in rows]
        if any(values):
            line, = ax.plot(x, values, style, label=f"{group} collectives")
            bad = [(i, v) for i, v in zip(x, values) if not rows[i]["feasible"]]
            if bad:  # hollow markers: infeasible layouts
                ax.plot(*zip(*bad), style[0], color="white", markeredgecolor=line.get_color(), linestyle="none")
    ax.set(ylabel="GB sent per device", title=f"communication {step} (ring bytes)")


def _node_marker(ax, rows: list[dict], devices_per_node: int) -> None:
    """A dotted vertical line between the last tp that fits in a node and the first that spans
    nodes; nothing when every tp is on one side."""
    tps = [r["tp"] for r in rows]
    inside = sum(t <= devices_per_node for t in tps)
    if inside in (0, len(tps)):
        return
    ax.axvline(inside - 0.5, color="grey", linestyle=":",
               label=f"node boundary ({devices_per_node} devices per node)")


def plot_losses(steps: list, losses: list, path: str, *, title: str = "") -> str:
    """The loss of every step a training run took, as a PNG; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, color="tab:blue", marker="o" if len(losses) <= 40 else None, markersize=3)
    ax.set(xlabel="step", ylabel="loss (next-token cross-entropy)", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
