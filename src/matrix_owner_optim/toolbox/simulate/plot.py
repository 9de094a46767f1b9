"""The sweep plot.

Part of :mod:`matrix_owner_optim.toolbox.simulate`; see its docstring for the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_PLOT_STYLE = {
    "reconstruction": ("tab:red", "-", "o"),
    "reconstruction_dtensor": ("tab:orange", "--", "v"),
    "all_to_all": ("tab:blue", "-", "s"),
    "owner": ("tab:green", "-", "^"),
}


def plot_sweep(rows: Sequence[Mapping[str, Any]], path: str, *, title: str = "") -> str:
    """Write a PNG: predicted optimizer-step time (ms, log y) vs node count per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = [r["nodes"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, (color, ls, marker) in _PLOT_STYLE.items():
        ys = [r["strategies"][name]["total_ms"] for r in rows]
        ax.plot(nodes, ys, color=color, linestyle=ls, marker=marker, label=name)
    ax.set_yscale("log")
    ax.set_xlabel(f"nodes ({rows[0]['gpus_per_node']} GPUs each)" if rows else "nodes")
    ax.set_ylabel("predicted optimizer step (ms, log)")
    ax.set_xticks(nodes)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
